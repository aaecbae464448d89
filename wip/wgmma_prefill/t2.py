import cutlass, cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.tensor_utils import LayoutEnum
from cutlass.cute.runtime import make_fake_compact_tensor
L = None
@cute.kernel
def k(x: cute.Tensor, L: cute.ComposedLayout):
    tidx,_,_ = cute.arch.thread_idx()
    smem = cutlass.memory.SmemAllocator()
    sB = smem.allocate_tensor(cutlass.BFloat16, L.outer, byte_alignment=1024, swizzle=L.inner)
    sB[(1, 0, 0)] = x[0]
    sB[(9, 3, 0)] = x[1]
    cute.arch.sync_threads()
    x[2] = sB[(tidx, 0, 0)]
@cute.jit
def host(x: cute.Tensor):
    L = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (128, 256, 64), cutlass.BFloat16, 4)
    k(x, L).launch(grid=[1,1,1], block=[128,1,1], smem=140000)
x = make_fake_compact_tensor(cutlass.BFloat16, (4,))
cute.compile(host, x)
print("ok")
