"""The C++ launcher module (built when a CUDA toolkit is present at install time)."""
import pytest

C = pytest.importorskip("moe_ext._C", reason="launcher not built (no CUDA toolkit at install time)")


def test_pointer_and_extent_checks():
    C.check_pointer("x", 256, 16)
    with pytest.raises(ValueError, match="x: pointer is not 16-byte aligned"):
        C.check_pointer("x", 8, 16)
    with pytest.raises(ValueError, match="power of two"):
        C.check_pointer("x", 8, 12)
    C.check_divisible("H", 7168, 128)
    with pytest.raises(ValueError, match="H: extent 2880 is not a multiple of 128"):
        C.check_divisible("H", 2880, 128)


def test_device_queries_do_not_raise_without_a_gpu():
    assert C.device_count() >= 0
    assert C.cuda_runtime_version() >= 12000
    assert isinstance(C.kernels(), list)
