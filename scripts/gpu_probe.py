"""Quick GPU facts for te_ops: grouped_mm support per dtype, sync-free eager, graph capture."""
import os, time, torch, te_ops
from te_ops.kernels.grouped_gemm import grouped_mm_unsupported_reason
dev = torch.device("cuda")
print(torch.__version__, torch.cuda.get_device_name(), torch.cuda.get_device_capability())
for dt in (torch.bfloat16, torch.float16, torch.float32):
    print(dt, "grouped_mm:", grouped_mm_unsupported_reason(dev, dt, 256, 512))
E, T, H, F = 8, 1024, 256, 512
for dt in (torch.bfloat16, torch.float16, torch.float32):
    for fusion in ("0", "1"):
        os.environ["TE_OPS_FUSION"] = fusion
        torch.manual_seed(0)
        blk = te_ops.Sequential(te_ops.GroupedLinear(E, H, 2 * F, device=dev, dtype=dt), te_ops.ScaledSwiGLU(),
                                te_ops.GroupedLinear(E, F, H, device=dev, dtype=dt))
        x = torch.randn(T, H, device=dev, dtype=dt, requires_grad=True)
        probs = torch.rand(T, device=dev, requires_grad=True)
        ss = torch.bincount(torch.randint(0, E, (T - 100,), device=dev), minlength=E)
        blk(x, ss, probs, ss).sum().backward()
        torch.cuda.synchronize()
        try:
            torch.cuda.set_sync_debug_mode("error")
            y = blk(x, ss, probs, ss); y.sum().backward()
            res = "no sync"
        except Exception as e:
            res = f"SYNC: {str(e)[:300]}"
        finally:
            torch.cuda.set_sync_debug_mode(0)
        print(dt, "fusion", fusion, res, "pad rows zero:", bool((y[T-100:] == 0).all()))
# graph capture via torch.cuda.make_graphed_callables
os.environ["TE_OPS_FUSION"] = "1"
dt = torch.bfloat16
torch.manual_seed(0)
blk = te_ops.Sequential(te_ops.GroupedLinear(E, H, 2 * F, device=dev, dtype=dt), te_ops.ScaledSwiGLU(),
                        te_ops.GroupedLinear(E, F, H, device=dev, dtype=dt))
x = torch.randn(T, H, device=dev, dtype=dt, requires_grad=True)
probs = torch.rand(T, device=dev, requires_grad=True)
ss = torch.bincount(torch.randint(0, E, (T,), device=dev), minlength=E)
blk(x, ss, probs, ss).sum().backward()
try:
    g = torch.cuda.make_graphed_callables(blk, (x, ss, probs, ss))
    ss2 = torch.tensor([0, 300, 0, 200, 100, 100, 0, 200], device=dev)
    y = g(x, ss2, probs, ss2); y.sum().backward()
    print("graphed ok", y.shape, bool((y[900:] == 0).all()))
except Exception as e:
    import traceback; traceback.print_exc()
