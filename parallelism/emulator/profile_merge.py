"""The median of several calibrations of one machine (pure).

A shared host's speed wanders in spells of seconds to minutes (docs/benchmarks-history.md,
session 9: two calibrations twelve minutes apart differed by a fifth in their memory-bound rates
while the real steps did not move). A calibration is one window of time; calibrations taken
at several times, each at its own window, combine into a profile of the machine's typical
state: every measured number its median over the calibrations, every table row's rate its
median at that row. `dynaplane calibrate --merge A.json B.json C.json --out P.json`.

Or the machine at its least disturbed (`--quietest`): the one calibration whose window ran
fastest, by all its measured rates against their medians. Neighbours on a shared host only
add time, so that window is the machine's own speed; it is what the fastest of many real
steps (the validation's yardstick) ran at. One whole calibration, not the best of each
number: the ops of one step share one window's state (docs/benchmarks-history.md, session 13).
"""
from __future__ import annotations

import math
import statistics

from parallelism.emulator.devices import DeviceProfile
from parallelism.emulator.errors import EmulatorError


def median_profile(profiles: list[DeviceProfile]) -> DeviceProfile:
    """Field by field median of `profiles`, which must be calibrations of the same kind:
    the same tables (kinds, shapes, sizes) and the same whole-number and yes/no fields."""
    if not profiles:
        raise EmulatorError("no profiles to merge")
    if len(profiles) == 1:
        return profiles[0]
    dicts = [p.to_dict() for p in profiles]
    merged = median_measurement(dicts, "")
    merged["notes"] = f"median of {len(profiles)} calibrations; the first: {dicts[0]['notes']}"
    return DeviceProfile.from_dict(merged)


def machine_speeds(profiles: list[DeviceProfile]) -> list[float]:
    """How fast the machine ran in each calibration's window, 1 = the calibrations' typical
    speed: the geometric mean, over every measured rate (GEMM, attention and memory-bound
    tables and rates, peak FLOP/s, memory bandwidth) and collective time (as its inverse),
    of the ratio to that measurement's median over the calibrations."""
    median_profile(profiles)  # the same measurements, or a clear error
    measured = [_speed_measurements(p.to_dict()) for p in profiles]
    logs = [[] for _ in profiles]
    for key in measured[0]:
        values = [m[key] for m in measured]
        typical = statistics.median(values)
        if typical > 0 and all(v > 0 for v in values):
            for i, v in enumerate(values):
                logs[i].append(math.log(v / typical))
    return [math.exp(statistics.fmean(ls)) if ls else 1.0 for ls in logs]


def quietest_calibration(profiles: list[DeviceProfile]) -> tuple[int, list[float]]:
    """The index of the calibration taken while the machine ran fastest, and every
    calibration's `machine_speeds` (which the choice is made by)."""
    speeds = machine_speeds(profiles)
    return max(range(len(profiles)), key=speeds.__getitem__), speeds


_RATES = ("matmul_table", "attention_table", "op_bandwidth_table", "op_bandwidth", "peak_flops", "hbm_bandwidth")


def _speed_measurements(profile: dict) -> dict[str, float]:
    """{where: higher-is-faster value} for every measured rate and collective time."""
    out: dict[str, float] = {}

    def walk(value, where: str, invert: bool) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                walk(inner, f"{where}[{key!r}]", invert)
        elif isinstance(value, (list, tuple)):
            for row in value:
                out[f"{where}{list(row[:-1])}"] = 1 / row[-1] if invert and row[-1] else row[-1]
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[where] = value

    for name in _RATES:
        walk(profile.get(name), name, invert=False)
    walk(profile.get("collective_table"), "collective_table", invert=True)  # seconds: lower is faster
    return out


def median_measurement(values: list, where: str = "measurement"):
    """The median of the same measurement taken several times: numbers, {name: ...}
    objects key by key, tables (lists of rows [key..., measured]) row by row. Whole
    numbers and yes/no values are properties of the machine, not measurements: they must
    agree. `where` names the measurement in errors."""
    first = values[0]
    if isinstance(first, bool) or isinstance(first, str):
        if isinstance(first, bool) and any(v != first for v in values):
            raise EmulatorError(f"cannot merge profiles: {where} differs ({sorted(set(values))})")
        return first
    if isinstance(first, int) and all(type(v) is int for v in values):
        if any(v != first for v in values):  # a machine's size (memory, ranks per node) is not a measurement
            raise EmulatorError(f"cannot merge profiles: {where} differs ({sorted(set(values))}); "
                                f"were they measured on the same machine with the same --ranks?")
        return first
    if isinstance(first, (int, float)):
        return statistics.median(values)
    if isinstance(first, dict):
        keys = list(first)
        for v in values[1:]:
            if not isinstance(v, dict) or sorted(v) != sorted(keys):
                raise EmulatorError(f"cannot merge profiles: {where} has different entries "
                                    f"({sorted(keys)} against {sorted(v) if isinstance(v, dict) else v!r}); "
                                    f"calibrate each with the same --model and --layout")
        return {key: median_measurement([v[key] for v in values], f"{where}[{key!r}]" if where else key)
                for key in keys}
    if isinstance(first, (list, tuple)):
        return _median_table(where, values)
    raise EmulatorError(f"cannot merge profiles: {where} is a {type(first).__name__}")


def _median_table(where: str, tables: list) -> list:
    """Rows [key..., measured]: the same keys in every table, the last column's median."""
    first = tables[0]
    for table in tables[1:]:
        if (not isinstance(table, (list, tuple)) or len(table) != len(first)
                or any(list(a[:-1]) != list(b[:-1]) for a, b in zip(first, table))):
            raise EmulatorError(f"cannot merge profiles: {where} was measured at different shapes or sizes; "
                                f"calibrate each with the same --model and --layout")
    return [[*row[:-1], statistics.median(t[i][-1] for t in tables)] for i, row in enumerate(first)]
