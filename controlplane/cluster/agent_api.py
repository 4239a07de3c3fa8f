"""REST: agent tokens (staff only: issue, shown once; list; revoke) and an agent's join (issue 44).

A joining agent presents its token in the body (never in a header: DRF's token authentication
reads `Authorization` for user tokens) and gets the broker URL it is to use, with its password,
and the node name the token speaks for."""
from __future__ import annotations

from django.conf import settings
from drf_spectacular.utils import OpenApiResponse, extend_schema, inline_serializer
from rest_framework import serializers, status
from rest_framework.exceptions import NotFound, ValidationError
from rest_framework.permissions import AllowAny, IsAdminUser
from rest_framework.response import Response
from rest_framework.throttling import AnonRateThrottle
from rest_framework.views import APIView

from controlplane.cluster.agent_tokens import TokenError, token_issue, token_joined, token_revoke
from controlplane.cluster.models import AgentToken


class AgentTokenSerializer(serializers.ModelSerializer):
    class Meta:
        model = AgentToken
        fields = ["key_id", "node", "note", "created_at", "created_by", "revoked_at", "last_joined_at"]


class IssueSerializer(serializers.Serializer):
    node = serializers.CharField(max_length=63, help_text="the node (agent --name) the token speaks for")
    note = serializers.CharField(max_length=200, required=False, allow_blank=True, default="")


class IssuedSerializer(AgentTokenSerializer):
    token = serializers.CharField(help_text="shown this once: only a key derived from it is kept")

    class Meta(AgentTokenSerializer.Meta):
        fields = [*AgentTokenSerializer.Meta.fields, "token"]


def _refused(exc: TokenError):
    return ValidationError({exc.field: [str(exc)]})


class AgentTokensView(APIView):
    permission_classes = [IsAdminUser]

    @extend_schema(responses={200: AgentTokenSerializer(many=True)})
    def get(self, request):
        rows = AgentToken.objects.all()
        if "node" in request.query_params:
            rows = rows.filter(node=request.query_params["node"][:63])
        return Response(AgentTokenSerializer(rows[:10_000], many=True).data)

    @extend_schema(request=IssueSerializer, responses={201: IssuedSerializer})
    def post(self, request):
        given = IssueSerializer(data=request.data)
        given.is_valid(raise_exception=True)
        try:
            row, token = token_issue(node=given.validated_data["node"], note=given.validated_data["note"],
                                     created_by=request.user.get_username())
        except TokenError as exc:
            raise _refused(exc) from None
        return Response({**AgentTokenSerializer(row).data, "token": token}, status=status.HTTP_201_CREATED)


class AgentTokenRevokeView(APIView):
    permission_classes = [IsAdminUser]

    @extend_schema(request=None, responses={200: AgentTokenSerializer})
    def post(self, request, key_id: str):
        try:
            row = token_revoke(key_id=key_id)
        except TokenError as exc:
            raise NotFound(str(exc)) from None
        return Response(AgentTokenSerializer(row).data)


class JoinThrottle(AnonRateThrottle):
    rate = "60/min"  # guessing a 256-bit token is hopeless; this bounds the work a flood costs


class AgentJoinView(APIView):
    permission_classes = [AllowAny]
    authentication_classes: list = []
    throttle_classes = [JoinThrottle]

    @extend_schema(
        request=inline_serializer("AgentJoin", {"token": serializers.CharField(), "node": serializers.CharField(
            required=False, help_text="the agent's --name, when given: it must be the token's node")}),
        responses={200: inline_serializer("AgentJoined", {"node": serializers.CharField(),
                                                          "key_id": serializers.CharField(),
                                                          "broker_url": serializers.CharField()}),
                   403: OpenApiResponse(description="the token is not one this control plane issued, or revoked"),
                   429: OpenApiResponse(description=f"more than {JoinThrottle.rate} joins from one address")})
    def post(self, request):
        body = request.data if isinstance(request.data, dict) else {}
        token, node = body.get("token"), body.get("node")
        if not isinstance(token, str) or len(token) > 200:
            raise ValidationError({"token": ["the agent token `dynaplane tokens issue` printed (a string)"]})
        try:
            row = token_joined(token)
        except TokenError as exc:
            return Response({exc.field: [str(exc)]}, status=status.HTTP_403_FORBIDDEN)
        if node not in (None, "", row.node):
            raise ValidationError({"node": [f"this token speaks for node {row.node}, not {str(node)[:63]!r}"]})
        return Response({"node": row.node, "key_id": row.key_id, "broker_url": settings.DYNAPLANE_AGENT_BROKER_URL})
