"""Fake arguments for compiling the kernels ahead of time on a machine without a GPU (the launcher checks the real
tensors against each kernel's entry before a launch)."""
from __future__ import annotations

import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_compact_tensor


def vector(dtype, align: int = 4):
    """A 1-D tensor of `dtype` and dynamic length whose data is `align`-byte aligned."""
    return make_fake_compact_tensor(dtype, (cute.sym_int(),), assumed_align=align)
