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


def test_launch_plan_checks_every_step_when_it_is_built():
    """A recorded forward is checked once, when its steps are added (no GPU needed); run() only patches the
    per-call pointers."""
    if not hasattr(C, "LaunchPlan") or "moe_finalize" not in C.kernels():
        pytest.skip("launcher built without the kernels")
    plan = C.LaunchPlan()
    buffers = [(4096, 8), (8192, 2), (12288, 2), (16384, 8)]
    plan.add_launch("moe_finalize", buffers, [128.0, 2.0], True, 0, [(2, 3)])
    plan.add_memset(16384, 16, 0)
    assert len(plan) == 2
    with pytest.raises(ValueError, match="expected 4 tensors and 2 scalars"):
        plan.add_launch("moe_finalize", buffers[:3], [128.0, 2.0], True, 0, [])
    with pytest.raises(ValueError, match="null pointer"):
        plan.add_launch("moe_finalize", [(0, 8)] + buffers[1:], [128.0, 2.0], True, 0, [])
    with pytest.raises(ValueError, match="not 4-byte aligned"):
        plan.add_launch("moe_finalize", [(4097, 8)] + buffers[1:], [128.0, 2.0], True, 0, [])
    with pytest.raises(ValueError, match="bad patch"):
        plan.add_launch("moe_finalize", buffers, [128.0, 2.0], True, 0, [(7, 0)])
    with pytest.raises(ValueError, match="no kernel named"):
        plan.add_launch("moe_nothing", buffers, [], True, 0, [])
