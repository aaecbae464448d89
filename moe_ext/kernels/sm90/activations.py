"""FC1 activations on fp32 registers (semantics §2.3), with the kernels' fast ex2/rcp sequence (branch-free:
inlined into the kernels at trace time).

`params` are four runtime fp32 values whose meaning depends on the kind (host side: moe_ext.launcher
.activation_params)."""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32

LOG2E = 1.4426950408889634
KINDS = ("swiglu", "situ", "geglu_tanh", "relu2")


def _sigmoid(x):
    return cute.arch.rcp_approx(Float32(1.0) + cute.math.exp2(x * Float32(-LOG2E), fastmath=True))


def _tanh(x):
    return Float32(2.0) * _sigmoid(x * Float32(2.0)) - Float32(1.0)


def apply(kind: str, up, gate, params):
    """Activation of one (up, gate) pair; Relu2 passes its projection as `gate` and ignores `up`."""
    p0, p1, p2, p3 = params
    if kind == "swiglu":  # p0 = -(alpha * log2e) folded in fp32, p1 = beta, p2 = limit
        g = cute.math.min(gate, p2)
        u = cute.math.max(cute.math.min(up, p2), -p2)
        sig = cute.arch.rcp_approx(Float32(1.0) + cute.math.exp2(p0 * g, fastmath=True))
        return (sig * g) * (u + p1)
    if kind == "situ":  # p0 = b, p1 = 1/b, p2 = c (0: no linear clamp), p3 = 1/c
        gate_term = (p0 * _tanh(gate * p1)) * _sigmoid(gate)
        linear = Float32(cutlass.select_(p2 > Float32(0.0), p2 * _tanh(up * p3), up))
        return linear * gate_term
    if kind == "geglu_tanh":
        inner = Float32(0.7978845608028654) * (gate + Float32(0.044715) * gate * gate * gate)
        return up * (Float32(0.5) * gate * (Float32(1.0) + _tanh(inner)))
    r = cute.math.max(gate, Float32(0.0))
    return r * r

