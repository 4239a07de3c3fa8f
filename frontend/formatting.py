"""The Python twin of frontend/static/frontend/format.js: the same texts for durations,
bytes (binary units), counts, rates, percentages and relative times, for the templates
(frontend/templatetags/dynaformat.py) and the figures' labels and hovers.

Never scientific notation: 3 significant digits in decimal form, moved to the next unit
when rounding reaches it (0.9996 s -> "1.00 s"). Rounding is half away from zero on the
float's exact value, as JavaScript's toFixed does (Python's own format rounds half to
even), so both sides print the same text; tests/test_format_js.py checks that they do.
"""
from __future__ import annotations

import math
from datetime import datetime
from decimal import ROUND_HALF_UP, Context, Decimal

_EXACT = Context(prec=800)  # enough digits for any float's exact value

DASH = "–"


def _missing(x) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x))


def _decimals_for(x: float, digits: int) -> int:
    """Decimal places that leave `digits` significant ones; the exponent is that of the
    shortest decimal form (repr), as JavaScript's toExponential() gives it."""
    if x == 0:
        return digits - 1
    return max(0, digits - 1 - Decimal(repr(float(x))).adjusted())


def _fixed(x: float, decimals: int) -> str:
    """JavaScript's x.toFixed(decimals): the exact binary value rounded half away from zero."""
    return format(Decimal(x).quantize(Decimal(1).scaleb(-decimals), rounding=ROUND_HALF_UP, context=_EXACT), "f")


def sig(x: float | None, digits: int = 3) -> str:
    """x with `digits` significant digits as decimals: 0.000588 -> "0.000588"; below 1e-15, "0"."""
    if _missing(x):
        return DASH
    x = float(x)
    if math.isinf(x):
        return "∞" if x > 0 else "-∞"
    if abs(x) < 1e-15:  # below any reading
        return "0"
    if abs(x) >= 1e21:  # as JavaScript's toPrecision(digits), with the zeros spelled out
        exact = Decimal(abs(x))
        exponent = exact.adjusted()
        mantissa = int(exact.scaleb(digits - 1 - exponent, context=_EXACT).quantize(Decimal(1), rounding=ROUND_HALF_UP,
                                                                                 context=_EXACT))
        if mantissa >= 10**digits:
            mantissa, exponent = mantissa // 10, exponent + 1
        return ("-" if x < 0 else "") + str(mantissa) + "0" * (exponent - digits + 1)
    decimals = _decimals_for(x, digits)
    text = _fixed(x, decimals)
    rounded = float(text)
    if rounded != 0 and _decimals_for(rounded, digits) < decimals:
        text = _fixed(x, _decimals_for(rounded, digits))
    if text.startswith("-") and float(text) == 0:
        text = text[1:]
    return text


def integer(n: float | None) -> str:
    """Whole numbers with thousands separators: 12345 -> "12,345"."""
    if _missing(n):
        return DASH
    return f"{int(_fixed(float(n), 0)):,}"


def _scaled(x: float, units: tuple[tuple[float, str], ...], digits: int = 3) -> str:
    pick = units[0]
    for unit in units:
        if abs(float(sig(x / unit[0], digits))) >= 1:
            pick = unit
    return f"{sig(x / pick[0], digits)} {pick[1]}"


SUB_SECOND = ((1e-9, "ns"), (1e-6, "µs"), (1e-3, "ms"), (1, "s"))


def duration(seconds: float | None) -> str:
    """ns/µs/ms/s below a minute, then "3 min 05 s", "2 h 05 min", "3 d 04 h"."""
    if _missing(seconds):
        return DASH
    seconds = float(seconds)
    if math.isinf(seconds):
        return "∞" if seconds > 0 else "-∞"
    if seconds < 0:
        return f"-{duration(-seconds)}"
    if seconds == 0:
        return "0 s"
    if float(sig(seconds)) < 60:
        return _scaled(seconds, SUB_SECOND)
    whole = int(_fixed(seconds, 0))
    if whole < 3600:
        return f"{whole // 60} min {whole % 60:02d} s"
    minutes = int(_fixed(seconds / 60, 0))
    if minutes < 24 * 60:
        return f"{minutes // 60} h {minutes % 60:02d} min"
    hours = int(_fixed(seconds / 3600, 0))
    return f"{integer(hours // 24)} d {hours % 24:02d} h"


BINARY = ((1, "B"), (2**10, "KiB"), (2**20, "MiB"), (2**30, "GiB"), (2**40, "TiB"), (2**50, "PiB"), (2**60, "EiB"))


def binary_bytes(n: float | None) -> str:
    """Bytes in binary units: "512 B", "1.50 KiB", "80.0 GiB"."""
    if _missing(n):
        return DASH
    if abs(n) < 1024:
        return f"{integer(n)} B"
    return _scaled(float(n), BINARY)


SI = ((1, ""), (1e3, "k"), (1e6, "M"), (1e9, "G"), (1e12, "T"), (1e15, "P"), (1e18, "E"))


def count(x: float | None) -> str:
    """A count with an SI prefix: "588", "12.3 k", "4.56 M"."""
    if _missing(x):
        return DASH
    x = float(x)
    if math.isinf(x):
        return "∞" if x > 0 else "-∞"
    return _scaled(x, SI).rstrip()


def rate(per_second: float | None, what: str) -> str:
    """rate(12345, "tokens") -> "12.3 k tokens/s"."""
    return DASH if _missing(per_second) else f"{count(per_second)} {what}/s"


def byte_rate(bytes_per_second: float | None) -> str:
    return DASH if _missing(bytes_per_second) else f"{binary_bytes(bytes_per_second)}/s"


def percent(fraction: float | None) -> str:
    """0.4534 -> "45.3 %"."""
    return DASH if _missing(fraction) else f"{sig(fraction * 100)} %"


def host_stats(cpu_percent: float | None, cpu_count: int | None, memory_used_bytes: float | None,
               memory_total_bytes: float | None) -> str:
    """A node's host as its agent last showed it: "CPU 45.3 % of 16 · mem 3.00 GiB / 16.0 GiB";
    "" before its first report with host stats."""
    if _missing(cpu_percent):
        return ""
    return (f"CPU {percent(cpu_percent / 100)} of {DASH if cpu_count is None else cpu_count} · mem "
            f"{binary_bytes(memory_used_bytes)} / {binary_bytes(memory_total_bytes)}")


def relative_seconds(seconds: float | None) -> str:
    """"just now", "42 s ago", "3 min ago", "5 h ago", "2 d ago"; "in 3 min" ahead."""
    if _missing(seconds):
        return DASH
    ahead, s = seconds < 0, abs(seconds)
    if s < 10:
        return "just now"
    if s < 60:
        text = f"{math.floor(s)} s"
    elif s < 3600:
        text = f"{math.floor(s / 60)} min"
    elif s < 86400:
        text = f"{math.floor(s / 3600)} h"
    else:
        text = f"{math.floor(s / 86400)} d"
    return f"in {text}" if ahead else f"{text} ago"


def relative_time(then: datetime | None, now: datetime) -> str:
    return DASH if then is None else relative_seconds((now - then).total_seconds())
