"""benchmarks/emulator_gap.py's op-by-op comparison: profiler events and trace ops pooled by name."""
from __future__ import annotations

import pytest

from benchmarks.emulator_gap import kernel_kind, op_family


@pytest.mark.parametrize("name,family", [
    ("aten::_foreach_mul_", "mul"), ("aten::mul_", "mul"), ("_foreach_mul_", "mul"), ("mul", "mul"),
    ("aten::_foreach_addcdiv_", "addcdiv"), ("aten::sqrt", "sqrt"), ("_foreach_sqrt", "sqrt"),
    ("aten::clone", "copy"), ("aten::copy_", "copy"), ("_to_copy", "copy"), ("aten::cat", "cat"),
    ("aten::_local_scalar_dense", "_local_scalar_dense"),
])
def test_an_optimizer_op_pools_with_its_in_place_foreach_and_copy_kin(name, family) -> None:
    # a clone's or a cast's kernel time is its copy_ in the profiler; the trace names the clone
    assert op_family(name) == family


def test_only_gemms_and_attention_count_as_kernels() -> None:
    assert kernel_kind("aten::mm") == kernel_kind("aten::addmm") == "matmul"
    assert kernel_kind("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention"
    assert kernel_kind("aten::mul") == ""
