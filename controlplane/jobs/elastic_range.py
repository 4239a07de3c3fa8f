"""The rules of a job's elastic settings (pure): its GPU range holds the GPUs it runs on and
fits the cluster. Checked at creation (services.job_check) and on every change
(elastic_settings.job_elastic_set); each message names the field and the rule."""
from __future__ import annotations


def range_problems(*, min_gpus: int | None, max_gpus: int | None, world_size: int,
                   cluster_gpus: int) -> dict[str, list[str]]:
    """What is wrong with the range [min_gpus, max_gpus] (a bound not set means world_size)
    for a job on `world_size` GPUs in a cluster of `cluster_gpus` (0: no inventory yet,
    nothing to compare with; an unset max_gpus is the job's size, which job creation checks
    against the cluster under its own field). Empty: nothing."""
    lo = world_size if min_gpus is None else min_gpus
    hi = world_size if max_gpus is None else max_gpus
    problems: dict[str, list[str]] = {}
    if lo > hi:
        problems.setdefault("max_gpus", []).append(f"max_gpus={hi} is below min_gpus={lo}")
    if cluster_gpus and max_gpus is not None and hi > cluster_gpus:  # (world_size has its own check)
        problems.setdefault("max_gpus", []).append(f"max_gpus={hi} exceeds the cluster's {cluster_gpus} GPUs")
    if lo > world_size:
        problems.setdefault("min_gpus", []).append(
            f"min_gpus={lo} is above the {world_size} GPUs the job runs on (world_size); the range must hold them")
    if hi < world_size:
        problems.setdefault("max_gpus", []).append(
            f"max_gpus={hi} is below the {world_size} GPUs the job runs on (world_size); the range must hold them")
    return problems
