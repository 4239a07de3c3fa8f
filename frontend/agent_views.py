"""The Agents page (staff only, issue 44): the tokens agents enrol with (node, key id, when issued
and by whom, when an agent last joined with it, revoked), a form that issues one and shows it
once with the command to run on the agent's host, and Revoke (agents.js, the agent-token API)."""
from __future__ import annotations

from django.contrib.admin.views.decorators import staff_member_required
from django.http import HttpRequest
from django.shortcuts import render

from controlplane.cluster.agent_tokens import tokens_listed


@staff_member_required(login_url="login")
def agents_page(request: HttpRequest):
    return render(request, "frontend/agents.html",
                  {"tokens": tokens_listed(), "join_url": request.build_absolute_uri("/")})
