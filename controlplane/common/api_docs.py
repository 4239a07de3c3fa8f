"""The API's ReDoc page as it works with no network: drf-spectacular's page without its Google
Fonts links (frontend/redoc.html), and drf-spectacular-sidecar's ReDoc bundle with the one
address it fetches by itself (the "API docs by Redocly" logo on cdn.redoc.ly) taken out: an
image with no address is never requested, and ReDoc then leaves the logo out."""
from __future__ import annotations

import functools
from pathlib import Path

from django.contrib.staticfiles import finders
from django.http import HttpResponse
from django.urls import reverse
from django.views.decorators.http import require_GET
from drf_spectacular.utils import extend_schema
from drf_spectacular.views import SpectacularRedocView

BUNDLE = "drf_spectacular_sidecar/redoc/bundles/redoc.standalone.js"
REMOTE_LOGO = "https://cdn.redoc.ly/redoc/logo-mini.svg"


@functools.cache
def offline_bundle() -> bytes:
    found = finders.find(BUNDLE)
    if not found:
        raise FileNotFoundError(BUNDLE)
    return Path(found).read_bytes().replace(REMOTE_LOGO.encode(), b"")


@require_GET
def redoc_bundle(request) -> HttpResponse:
    response = HttpResponse(offline_bundle(), content_type="text/javascript; charset=utf-8")
    response["Cache-Control"] = "public, max-age=86400"
    return response


class OfflineRedocView(SpectacularRedocView):
    template_name = "frontend/redoc.html"

    @extend_schema(exclude=True)
    def get(self, request, *args, **kwargs):
        response = super().get(request, *args, **kwargs)  # (rendered later: the data can still change)
        response.data["redoc_standalone"] = reverse("api-redoc-bundle")
        return response
