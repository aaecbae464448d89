import cutlass, cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.tensor_utils import LayoutEnum
@cute.jit
def f():
    L = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (128, 256, 64), cutlass.BFloat16, 4)
    o = L.outer
    for (n,k,s) in [(0,0,0),(1,0,0),(7,0,0),(8,0,0),(9,3,0),(0,8,1),(255,63,3)]:
        print((n,k,s), "outer elem off =", cute.crd2idx((n,k,s), o), " composed =", cute.crd2idx((n,k,s), L))
    print("inner", L.inner, "cosize", cute.cosize(L), "stage elems", cute.cosize(cute.slice_(L,(None,None,0))))
f()
