"""The 500 page with the site's navigation. Django's own server_error renders 500.html
without the request (no user, so no nav); this one passes it, and falls back to a plain
page when rendering with the request fails too (the database behind the session may be
what broke)."""
from __future__ import annotations

import logging

from django.db import DatabaseError
from django.http import HttpRequest, HttpResponse, HttpResponseServerError
from django.template import TemplateDoesNotExist, TemplateSyntaxError, loader

logger = logging.getLogger(__name__)

PLAIN = ("<!doctype html><title>Server error · dynaplane</title><h1>Server error (500)</h1>"
         '<p>The control plane failed to answer this page. <a href="/">Cluster</a> · <a href="/jobs/">Jobs</a></p>')


def server_error(request: HttpRequest) -> HttpResponse:
    try:
        return HttpResponseServerError(loader.render_to_string("500.html", {}, request))
    except (DatabaseError, TemplateDoesNotExist, TemplateSyntaxError):
        logger.exception("the 500 page failed to render; answering a plain one")
        return HttpResponseServerError(PLAIN)
