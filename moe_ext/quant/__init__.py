"""Formats the fused-MoE API consumes: fp4/fp8 element codes, block scales, the 128x4 scale swizzle, the w1
up/gate interleave, and the preparation of kernel-ready weights and activations."""
from .block import (
    BlockQuantized,
    mxfp4_dequantize,
    mxfp4_quantize,
    mxfp8_dequantize,
    mxfp8_quantize,
    nvfp4_dequantize,
    nvfp4_quantize,
    nvfp4_quantize_fc2_input,
    nvfp4_quantize_per_token,
)
from .formats import (
    e2m1_decode,
    e2m1_encode,
    e4m3_decode,
    e4m3_encode,
    pack_e2m1,
    ue8m0_decode,
    ue8m0_encode_ceil,
    unpack_e2m1,
)
from .interleave import deinterleave_up_gate, interleave_up_gate
from .prepare import (
    PreparedWeights,
    QuantizedActivation,
    nvfp4_global_scale,
    prepare_moe_weights,
    quantize_activation,
    slice_experts,
    split_localized_shards,
)
from .swizzle import mma_view, swizzle_offsets, swizzle_sf, swizzled_size, unswizzle_sf

__all__ = [name for name in dir() if not name.startswith("_")]
