"""Domain errors raised by services, and their mapping to HTTP for the API.

400: ValidationError (field -> messages); 404: NotFound; 409: Conflict (the request is
valid but the object's current state forbids it); 503: the database does not answer (a restart,
a failover: the request did nothing and may be sent again).
"""
from __future__ import annotations

from django.db import InterfaceError, OperationalError
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


# What a database that restarts raises (connection refused, closed, terminated by the admin).
DATABASE_DOWN = (OperationalError, InterfaceError)
DATABASE_DOWN_DETAIL = "the database is not answering (restarting?); nothing was changed: try again shortly"
RETRY_AFTER_SECONDS = 5


class DatabaseUnavailable(APIException):
    status_code = status.HTTP_503_SERVICE_UNAVAILABLE
    default_detail = DATABASE_DOWN_DETAIL
    default_code = "database_unavailable"


def api_exception_handler(exc: Exception, context: dict):
    """DRF's handler, plus the domain errors and a database that does not answer (503)."""
    if isinstance(exc, DATABASE_DOWN):
        response = exception_handler(DatabaseUnavailable(), context)
        response["Retry-After"] = str(RETRY_AFTER_SECONDS)
        return response
    if isinstance(exc, Conflict):
        exc = ConflictAPIError(detail=str(exc))
    elif isinstance(exc, InvalidInput):
        from rest_framework.exceptions import ValidationError

        exc = ValidationError(detail=exc.errors)
    return exception_handler(exc, context)
