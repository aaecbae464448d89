"""FC1 activations (semantics §2.3): FlashInfer's enum values, parameter validation and the fp32 formulas."""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch

from .quant.formats import FLT_MAX

LOG2E = 1.4426950408889634
GELU_TANH_K = 0.7978845608028654
GELU_TANH_C = 0.044715


class ActivationType(enum.IntEnum):
    """FlashInfer's ActivationType values; the fused MoE accepts Swiglu, Relu2 and GegluTanh."""

    Gelu = 0
    Relu = 1
    Silu = 2
    Swiglu = 3
    Geglu = 4
    SwigluBias = 5
    Relu2 = 6
    SwigluStep = 7
    GegluTanh = 8
    Identity = 9
    Situ = 10
    InvalidType = 11


SUPPORTED = (ActivationType.Swiglu, ActivationType.Relu2, ActivationType.GegluTanh)


@dataclass(frozen=True)
class Activation:
    """A validated activation: `kind` is one of swiglu, situ, geglu_tanh, relu2."""

    kind: str
    swiglu_alpha: float = 1.0
    swiglu_beta: float = 0.0
    swiglu_limit: float = FLT_MAX
    situ_beta: float | None = None
    situ_linear_beta: float | None = None

    @property
    def gated(self) -> bool:
        return self.kind != "relu2"

    @property
    def activation_type(self) -> int:
        return int({"relu2": ActivationType.Relu2, "geglu_tanh": ActivationType.GegluTanh}.get(
            self.kind, ActivationType.Swiglu))

    def cache_key(self) -> tuple:
        return (self.kind, self.swiglu_alpha, self.swiglu_beta, self.swiglu_limit, self.situ_beta,
                self.situ_linear_beta)

    @staticmethod
    def resolve(activation_type, swiglu_alpha=1.0, swiglu_beta=0.0, swiglu_limit=FLT_MAX, situ_beta=None,
                situ_linear_beta=None) -> "Activation":
        """Validate the API's activation arguments; raises TypeError/ValueError naming the bad one."""
        if isinstance(activation_type, bool) or not isinstance(activation_type, int):
            raise TypeError(f"activation_type must be an int (ActivationType), got {type(activation_type).__name__}")
        if activation_type == ActivationType.Situ:
            raise ValueError("activation_type: Situ (10) is not accepted; pass ActivationType.Swiglu with situ_beta")
        if activation_type not in [int(a) for a in SUPPORTED]:
            raise ValueError(
                f"activation_type must be one of Swiglu=3, Relu2=6, GegluTanh=8, got {activation_type}")
        for name, value in (("swiglu_alpha", swiglu_alpha), ("swiglu_beta", swiglu_beta),
                            ("swiglu_limit", swiglu_limit)):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name} must be a float, got {type(value).__name__}")
            if math.isnan(value):
                raise ValueError(f"{name} must not be NaN")
        for name, value in (("situ_beta", situ_beta), ("situ_linear_beta", situ_linear_beta)):
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name} must be a float or None, got {type(value).__name__}")
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be finite and > 0, got {value}")
        if situ_linear_beta is not None and situ_beta is None:
            raise ValueError("situ_linear_beta requires situ_beta (SiTU) to be set")
        if situ_beta is not None:
            if activation_type != ActivationType.Swiglu:
                raise ValueError("situ_beta selects SiTU and requires activation_type=ActivationType.Swiglu")
            return Activation("situ", situ_beta=float(situ_beta),
                              situ_linear_beta=None if situ_linear_beta is None else float(situ_linear_beta))
        if activation_type == ActivationType.Relu2:
            return Activation("relu2")
        if activation_type == ActivationType.GegluTanh:
            return Activation("geglu_tanh")
        return Activation("swiglu", float(swiglu_alpha), float(swiglu_beta), float(swiglu_limit))

    def apply(self, up: torch.Tensor | None, gate: torch.Tensor) -> torch.Tensor:
        """fp32 activation of scaled GEMM1 outputs. Non-gated (Relu2) passes its projection as `gate`, up=None."""
        if self.kind == "relu2":
            r = torch.clamp_min(gate, 0.0)
            return r * r
        const = lambda v: torch.tensor(v, dtype=torch.float32, device=gate.device)  # noqa: E731  fp32 constants
        if self.kind == "swiglu":
            limit = const(self.swiglu_limit)
            g = torch.minimum(gate, limit)
            u = torch.clamp(up, -limit, limit)
            sig = 1.0 / (1.0 + torch.exp2(const(-(self.swiglu_alpha * LOG2E)) * g))
            return (sig * g) * (u + const(self.swiglu_beta))
        if self.kind == "situ":
            b = const(self.situ_beta)
            gate_term = (b * _tanh(gate * (1.0 / b))) * _sigmoid(gate)
            if self.situ_linear_beta is not None:
                c = const(self.situ_linear_beta)
                up = c * _tanh(up * (1.0 / c))
            return up * gate_term
        # geglu_tanh
        inner = GELU_TANH_K * (gate + GELU_TANH_C * gate * gate * gate)
        return up * (0.5 * gate * (1.0 + _tanh(inner)))


def _sigmoid(x: torch.Tensor) -> torch.Tensor:
    return 1.0 / (1.0 + torch.exp2(-LOG2E * x))


def _tanh(x: torch.Tensor) -> torch.Tensor:
    # The kernels build tanh from the sigmoid; kept so the reference follows the same op sequence.
    return 2.0 * _sigmoid(2.0 * x) - 1.0
