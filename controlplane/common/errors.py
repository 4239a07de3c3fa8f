"""Domain errors raised by services, and their mapping to HTTP for the API.

400: ValidationError (field -> messages); 404: NotFound; 409: Conflict (the request is
valid but the object's current state forbids it).
"""
from __future__ import annotations

from rest_framework import status
from rest_framework.exceptions import APIException
from rest_framework.views import exception_handler


class DomainError(Exception):
    """Base for errors the services raise on purpose."""


class Conflict(DomainError):
    """The current state of an object forbids the action (HTTP 409)."""


class InvalidInput(DomainError):
    """Input broke a rule; `errors` maps field names to messages (HTTP 400)."""

    def __init__(self, errors: dict[str, list[str]]) -> None:
        super().__init__("; ".join(f"{k}: {' '.join(v)}" for k, v in errors.items()))
        self.errors = errors


class ConflictAPIError(APIException):
    status_code = status.HTTP_409_CONFLICT
    default_detail = "conflicting state"
    default_code = "conflict"


class PayloadTooLarge(APIException):
    status_code = status.HTTP_413_REQUEST_ENTITY_TOO_LARGE
    default_detail = "the request body is too large"
    default_code = "too_large"


def api_exception_handler(exc: Exception, context: dict):
    """DRF's handler, plus the domain errors."""
    if isinstance(exc, Conflict):
        exc = ConflictAPIError(detail=str(exc))
    elif isinstance(exc, InvalidInput):
        from rest_framework.exceptions import ValidationError

        exc = ValidationError(detail=exc.errors)
    return exception_handler(exc, context)
