"""CuTe-DSL kernels for Hopper (sm_90a), one per module, compiled ahead of time by `build.py` and launched
through the C++ launcher `moe_ext._C`. Importing this package does not import CuTe-DSL."""
