"""Rank 0 of an SP=4 Ulysses step on fake tensors + fake process group, counted by MemTracker."""

import sys, torch, torch.distributed as dist

sys.path.insert(0, ".")
sys.path.insert(0, "trainer")  # run from the repository root
from torch.testing._internal.distributed.fake_pg import FakeStore

dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
import deepspeed

deepspeed.init_distributed(dist_backend="fake")
import torch.nn.functional as F
from transformers import LlamaConfig, AutoModelForCausalLM
from transformers.modeling_utils import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from memfit_trainer.fake_trace import PhaseMemTracker, fake_run, fake_weights, categories_of


def causal_no_mask(module, q, k, v, attention_mask, position_ids=None, **kw):  # flash-like: no mask
    return sdpa_attention_forward(module, q, k, v, None, is_causal=True, **kw)


AttentionInterface.register("memfit_causal_standin", causal_no_mask)
cfg = LlamaConfig(
    hidden_size=1024,
    intermediate_size=3584,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=32000,
    use_cache=False,
)
with torch.device("meta"):
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="memfit_causal_standin", dtype=torch.bfloat16)
model.train()
from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

S, P = 8192, 4
mpu = UlyssesSPAttentionHF.register_with_transformers(
    model,
    "memfit_causal_standin",
    sequence_parallel_size=P,
    micro_batch_size=1,
    seq_length=S,
    seq_length_is_variable=False,
)
ids = torch.randint(0, 32000, (1, S // P))
pos = torch.arange(S // P).unsqueeze(0)
lab = ids.clone()
with fake_run("implicit") as mode:
    fake_weights(model)
    ids, pos, lab = (mode.from_tensor(t) for t in (ids, pos, lab))
    tracker = PhaseMemTracker()
    tracker.track_external(model)
    with tracker:
        tracker.phase_summary()
        h = model.model(input_ids=ids, position_ids=pos).last_hidden_state
        loss = F.cross_entropy(model.lm_head(h).float().view(-1, 32000), lab.view(-1))
        fwd = tracker.phase_summary()
        loss.backward()
        peak = tracker.phase_summary()
print("forward", fwd["peak"], "\nbackward", peak["peak"])
