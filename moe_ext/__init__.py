"""moe_ext: FlashInfer's 4-bit block-scaled fused MoE API (`cute_dsl_fused_moe`) for NVIDIA Hopper.

Same signature, input formats and numerics as FlashInfer; a readable PyTorch reference runs the same contract on
any device, and `torch.ops.moe.fused` exposes it to torch.compile.
"""
from . import ops  # noqa: F401  (registers torch.ops.moe.fused)
from .activation import ActivationType
from .api import cute_dsl_fused_moe
from .quant import PreparedWeights, prepare_moe_weights, quantize_activation, split_localized_shards
from .tuning import autotune
from .wrapper import CuteDslMoEWrapper

__version__ = "0.1.0"
__all__ = [
    "ActivationType",
    "CuteDslMoEWrapper",
    "PreparedWeights",
    "autotune",
    "cute_dsl_fused_moe",
    "prepare_moe_weights",
    "quantize_activation",
    "split_localized_shards",
]
