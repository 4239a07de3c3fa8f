"""What accelerators this node has: real CUDA devices (via nvidia-smi, so the agent
process never imports torch) or K virtual CPU devices."""
from __future__ import annotations

import os
import shutil
import subprocess

from agents.protocol import GpuReport

VIRTUAL_MODEL_NAME = "virtual-cpu"


class InventoryError(RuntimeError):
    """The node cannot report the devices it was asked to manage."""


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def virtual_gpus(count: int, memory_bytes: int | None = None) -> tuple[GpuReport, ...]:
    """K virtual devices backed by the CPU; each gets an equal share of host RAM by default."""
    per_gpu = memory_bytes or max(1, host_memory_bytes() // max(count, 1))
    return tuple(
        GpuReport(index=i, model_name=VIRTUAL_MODEL_NAME, memory_bytes=per_gpu, uuid=f"virtual-{i}")
        for i in range(count)
    )


def parse_nvidia_smi(csv_text: str) -> tuple[GpuReport, ...]:
    """Parse `nvidia-smi --query-gpu=index,name,memory.total,uuid --format=csv,noheader,nounits`.

    Example line: ``0, NVIDIA H100 80GB HBM3, 81559, GPU-5c2f...`` (memory in MiB).
    """
    reports = []
    for line in csv_text.strip().splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 4:
            raise InventoryError(f"unexpected nvidia-smi line: {line!r}")
        index, name, mib, uuid = fields
        reports.append(GpuReport(index=int(index), model_name=name, memory_bytes=int(mib) * 2**20, uuid=uuid))
    return tuple(reports)


def cuda_gpus(limit: int | None = None) -> tuple[GpuReport, ...]:
    """The node's CUDA devices; `limit` keeps the first K (0 or None: all)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        raise InventoryError("--device cuda: nvidia-smi not found; is the NVIDIA driver installed?")
    result = subprocess.run(
        [smi, "--query-gpu=index,name,memory.total,uuid", "--format=csv,noheader,nounits"],
        capture_output=True, text=True, timeout=30, check=False,
    )
    if result.returncode != 0:
        raise InventoryError(f"nvidia-smi failed ({result.returncode}): {result.stderr.strip()}")
    gpus = parse_nvidia_smi(result.stdout)
    if not gpus:
        raise InventoryError("--device cuda: nvidia-smi lists no GPUs")
    if limit:
        if limit > len(gpus):
            raise InventoryError(f"--gpus {limit} but this node has {len(gpus)} CUDA devices")
        gpus = gpus[:limit]
    return gpus


def discover(device: str, count: int, memory_bytes: int | None = None) -> tuple[GpuReport, ...]:
    if device == "cuda":
        return cuda_gpus(count)
    return virtual_gpus(count, memory_bytes)
