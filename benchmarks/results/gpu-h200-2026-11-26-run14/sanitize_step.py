import torch
from pnm_kernels import PNM, AdaPNM
for dtype in (torch.float32, torch.bfloat16, torch.float64):
    for opt_cls in (PNM, AdaPNM):
        for backend in ("fused", "triton") if dtype != torch.float64 else ("fused",):
            ps = [torch.randn(s, device="cuda", dtype=dtype).requires_grad_()
                  for s in [(1,), (3,), (4097,), (70001,), (33, 5)]]
            odd = torch.randn(1001, device="cuda", dtype=dtype)[1:].requires_grad_()  # misaligned
            opt = opt_cls(ps + [odd], lr=1e-3, backend=backend)
            for _ in range(3):
                for p in ps + [odd]:
                    p.grad = torch.randn_like(p)
                opt.step()
torch.cuda.synchronize()
print("sanitized step ran")
