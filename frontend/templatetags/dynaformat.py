"""Template filters of the one formatter (frontend/formatting.py, the twin of format.js):
{% load dynaformat %} then {{ seconds|duration }}, {{ n|binary_bytes }}, {{ x|count }},
{{ fraction|percent }}, {{ n|integer }}, {{ when|reltime }} (a <time> element: relative text, the time on
hover; format.js's liveTimes keeps it fresh and puts the browser's local time there)."""
from __future__ import annotations

from datetime import datetime, timezone as dt_timezone

from django import template
from django.utils import timezone
from django.utils.html import format_html

from frontend import formatting

register = template.Library()

register.filter("duration", formatting.duration)
register.filter("binary_bytes", formatting.binary_bytes)
register.filter("count", formatting.count)
register.filter("percent", formatting.percent)
register.filter("sig", formatting.sig)
register.filter("integer", formatting.integer)


@register.filter
def reltime(when: datetime | str | None):
    """<time datetime=ISO title="YYYY-MM-DD HH:MM:SS UTC" data-relative>3 min ago</time>."""
    if isinstance(when, str):
        try:
            when = datetime.fromisoformat(when)
        except ValueError:
            return formatting.DASH
    if when is None:
        return formatting.DASH
    if timezone.is_naive(when):
        when = timezone.make_aware(when, dt_timezone.utc)
    utc = when.astimezone(dt_timezone.utc)
    return format_html('<time datetime="{}" title="{}" data-relative>{}</time>', utc.isoformat(),
                       utc.strftime("%Y-%m-%d %H:%M:%S UTC"), formatting.relative_time(utc, timezone.now()))
