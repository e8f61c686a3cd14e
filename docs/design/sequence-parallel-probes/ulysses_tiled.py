"""2 gloo ranks: DeepSpeed ALST Ulysses (UlyssesSPAttentionHF) on a tiny packed Llama vs the unsplit model."""

import copy, torch, torch.distributed as dist, torch.nn.functional as F
import deepspeed
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.modeling_utils import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

deepspeed.init_distributed(dist_backend="gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)


def sdpa_with_documents(module, q, k, v, attention_mask, position_ids=None, **kw):
    # causal attention inside each packed document, from the (gathered) position ids
    doc = (position_ids == 0).cumsum(-1)
    s = doc.shape[-1]
    causal = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    mask = (doc[:, :, None] == doc[:, None, :]) & causal
    return sdpa_attention_forward(module, q, k, v, mask[:, None], **kw)


AttentionInterface.register("memfit_sdpa_documents", sdpa_with_documents)
cfg = LlamaConfig(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=256,
    use_cache=False,
)
cfg._attn_implementation = "sdpa"
ref = LlamaForCausalLM(cfg).float().train()
model = copy.deepcopy(ref)
model.config._attn_implementation = "memfit_sdpa_documents"

S = 32
ids = torch.randint(0, 128, (1, S))
pos = torch.cat([torch.arange(11), torch.arange(S - 11)]).unsqueeze(0)  # two packed documents
labels = ids.clone()
labels[0, :3] = -100
# reference: transformers' own packed path (block-diagonal mask from position_ids)
out = ref(input_ids=ids, position_ids=pos, labels=labels)
out.loss.backward()

from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

mpu = UlyssesSPAttentionHF.register_with_transformers(
    model,
    "memfit_sdpa_documents",
    sequence_parallel_size=world,
    micro_batch_size=1,
    seq_length=S,
    seq_length_is_variable=False,
)
group = mpu.get_sequence_parallel_group()
shifted = F.pad(labels, (0, 1), value=-100)[..., 1:]  # shift before sharding
chunk = S // world
sl = slice(rank * chunk, (rank + 1) * chunk)
import math, types
from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP, TiledFusedLogitsLoss


def tiled_forward(self, x):
    params = [p for p in self.parameters()]
    return TiledMLP.apply(lambda m, t: m.down_proj(m.act_fn(m.gate_proj(t)) * m.up_proj(t)), self, x, 4, params)


for layer in model.model.layers:
    layer.mlp.forward = types.MethodType(tiled_forward, layer.mlp)
hidden = model.model(input_ids=ids[:, sl], position_ids=pos[:, sl]).last_hidden_state


def shard_loss(lm, x, y):
    return F.cross_entropy(lm.lm_head(x).float().view(-1, 128), y.reshape(-1), ignore_index=-100, reduction="sum")


from deepspeed.runtime.sequence_parallel.ulysses_sp import sequence_tiled_compute


def shard_loss_kw(x=None, y=None):
    return F.cross_entropy(model.lm_head(x).float().view(-1, 128), y.reshape(-1), ignore_index=-100, reduction="sum")


loss_sum = sequence_tiled_compute(
    shard_loss_kw,
    hidden.shape[1],
    4,
    {"x": hidden, "y": shifted[:, sl]},
    {},
    "x",
    [model.lm_head.weight],
    output_unshard_dimension=0,
    output_reduction="sum",
)
count = (shifted[:, sl] != -100).sum().float()
dist.all_reduce(count, group=group)
local = loss_sum / count  # this rank's share of the sequence's mean loss
local.backward()
total = local.detach().clone()
dist.all_reduce(total, group=group)
worst = 0.0
for (n, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
    g = p.grad.clone()
    dist.all_reduce(g, group=group)  # what the engine's reduction sums
    worst = max(worst, ((g - r.grad).abs().max() / (r.grad.abs().max() + 1e-12)).item())
print(
    f"tiled MLP + SequenceTiledCompute loss: rank {rank}: loss split {total.item():.6f} unsplit {out.loss.item():.6f}; worst relative grad diff {worst:.2e}",
    flush=True,
)

# the ArcticTraining-style replicated loss (differentiable all_gather of each rank's mean): gradient scale
model.zero_grad(set_to_none=True)
hidden = model.model(input_ids=ids[:, sl], position_ids=pos[:, sl]).last_hidden_state
lsum = shard_loss(model, hidden, shifted[:, sl])
good = (shifted[:, sl] != -100).sum()
import torch.distributed.nn.functional as dnn

losses = dnn.all_gather(lsum / good, group=group)
goods = dnn.all_gather(good, group=group)
replicated = sum(l * g for l, g in zip(losses, goods)) / sum(goods)
replicated.backward()
g = model.lm_head.weight.grad.clone()
dist.all_reduce(g, group=group)
print(
    f"replicated all_gather loss (plain CE): rank {rank}: summed grad / unsplit grad = {(g.norm() / ref.lm_head.weight.grad.norm()).item():.3f}",
    flush=True,
)
