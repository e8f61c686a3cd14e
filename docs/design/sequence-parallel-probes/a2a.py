import os, torch, torch.distributed as dist

dist.init_process_group("gloo")
r, w = dist.get_rank(), dist.get_world_size()
x = torch.arange(8, dtype=torch.float32).reshape(4, 2) + 100 * r
out = torch.empty_like(x)
dist.all_to_all_single(out, x)
print(r, "a2a_single", out.flatten().tolist(), flush=True)
# bf16
xb = x.bfloat16()
ob = torch.empty_like(xb)
dist.all_to_all_single(ob, xb)
print(r, "bf16 ok", flush=True)
# differentiable torch.distributed.nn
import torch.distributed.nn.functional as F

y = x.clone().requires_grad_()
o = F.all_to_all_single(torch.empty_like(y), y)
(o * (r + 1)).sum().backward()
print(r, "grad", y.grad.flatten().tolist(), flush=True)
# subgroup
g = dist.new_group([0, 1])
dist.all_to_all_single(out, x, group=g)
print(r, "subgroup ok", flush=True)
# deepspeed path
import deepspeed

deepspeed.init_distributed(dist_backend="gloo")
from deepspeed.sequence.layer import _dim_zero_all_to_all, register_all_to_all_group

register_all_to_all_group(g)
z = torch.randn(2, 3, 4, requires_grad=True)
o = _dim_zero_all_to_all(g, z)
o.sum().backward()
print(r, "ds a2a ok", tuple(o.shape), z.grad.shape, flush=True)
dist.destroy_process_group()
