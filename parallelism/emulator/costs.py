"""Seconds of one op on a device: compute ops by the profile's roofline, collectives by network.py."""
from __future__ import annotations

from parallelism.emulator.devices import DeviceProfile
from parallelism.emulator.network import collective_seconds
from parallelism.emulator.trace import CommOp, ComputeOp, Op


def compute_seconds(op: ComputeOp, profile: DeviceProfile) -> float:
    """max(compute roof, memory roof) + launch gap. Memory-bound ops compute at the fp32 CUDA-core rate;
    the memory roof is the op's own measured bandwidth where the profile has one (op_bandwidth).
    A host op (DTensor's sharding dispatch) costs the profile's dispatch_seconds and no kernel."""
    if op.kind == "host":
        return profile.dispatch_seconds
    if op.kind == "matmul":
        rate = profile.matmul_rate(op.dtype, op.shape, op.form)
    elif op.kind == "attention":
        rate = profile.attention_rate(op.name, op.dtype, op.shape)
    else:
        rate = profile.peak("fp32")
        bandwidth = profile.op_memory_bandwidth(op.name, op.bytes, op.source, op.dtype, op.role)
        return max(op.flops / rate, op.bytes / bandwidth) + profile.launch_seconds
    return max(op.flops / rate, op.bytes / profile.op_memory_bandwidth(op.name)) + profile.launch_seconds


def op_seconds(op: Op, profile: DeviceProfile, gpus_per_node: int = 8) -> float:
    if isinstance(op, CommOp):
        return collective_seconds(op, profile, gpus_per_node)
    return compute_seconds(op, profile)
