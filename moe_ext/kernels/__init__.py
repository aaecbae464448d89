"""GPU kernels of moe_ext, one package per architecture."""
