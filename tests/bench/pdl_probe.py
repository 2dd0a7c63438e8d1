import numpy as np, traceback
from kernels.cuda_backend import CudaBackend
from kernels.fused_gpu import FusedGpu, ActBuffer
b = CudaBackend(); cp = b.xp; fg = FusedGpu(b)
x = cp.ones((4, 256), dtype=cp.float32); act = ActBuffer(cp, 256)
op = fg.op_prep_rows("p", x, 256, 0, None, 0.0, 256, False, act, 2)
print("launcher", b._pdl_launcher(), b.pdl_error)
try:
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        b._launch_pdl(op, s)
    s.synchronize(); print("eager pdl launch ok")
except Exception: traceback.print_exc()
g = b.capture_graph([op, op]); print("captured, pdl_used", b.pdl_used, b.pdl_error)
