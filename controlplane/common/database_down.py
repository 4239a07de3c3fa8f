"""Pages (outside DRF's exception handler) while the database does not answer: a 503 saying so,
never a 500 with a traceback (issue 43). The API's views get the same from
errors.api_exception_handler."""
from __future__ import annotations

import logging

from django.http import HttpResponse, JsonResponse

from controlplane.common.errors import DATABASE_DOWN, DATABASE_DOWN_DETAIL, RETRY_AFTER_SECONDS

log = logging.getLogger(__name__)


class DatabaseDownMiddleware:
    def __init__(self, get_response) -> None:
        self.get_response = get_response

    def __call__(self, request):
        return self.get_response(request)

    def process_exception(self, request, exception):
        if not isinstance(exception, DATABASE_DOWN):
            return None
        log.warning("%s %s: 503, the database does not answer: %s", request.method, request.path, exception)
        if request.path.startswith("/api/") or "application/json" in request.headers.get("Accept", ""):
            response = JsonResponse({"detail": DATABASE_DOWN_DETAIL}, status=503)
        else:
            response = HttpResponse(f"<!doctype html><title>dynaplane: database unavailable</title>"
                                    f"<h1>503: database unavailable</h1><p>{DATABASE_DOWN_DETAIL}.</p>",
                                    status=503)
        response["Retry-After"] = str(RETRY_AFTER_SECONDS)
        return response
