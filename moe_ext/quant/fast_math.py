"""The kernels' approximate reciprocal, for the reference quantizers that must round exactly like the kernels.

FlashInfer's quantizers (semantics §2.4a/b) form their scales with PTX `rcp.approx.ftz.f32`, which can be one ulp
away from 1/x. bf16 inputs put many values exactly on e2m1 / e4m3 rounding midpoints, where that ulp decides the
code, so on CUDA tensors the reference runs the same instruction (a one-line jiterator kernel, compiled once per
process by NVRTC). The instruction's rounding is not specified in closed form, so on the CPU the correctly rounded
reciprocal stands in, and CPU references may differ from the kernels by one code at such ties.
"""
from __future__ import annotations

import torch

_RCP_APPROX_FTZ = """
template <typename T> T rcp_approx_ftz(T x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
"""
_jit_rcp = None


def rcp_approx(x: torch.Tensor | float, device: torch.device | str | None = None) -> torch.Tensor:
    """float32 1/x as `rcp.approx.ftz.f32` on CUDA (x, or a Python float placed on `device`); exact on the CPU."""
    global _jit_rcp
    x = torch.as_tensor(x, dtype=torch.float32, device=device)
    if x.device.type != "cuda":
        return 1.0 / x
    if _jit_rcp is None:
        _jit_rcp = torch.cuda.jiterator._create_jit_fn(_RCP_APPROX_FTZ)
    return _jit_rcp(x)
