"""Ulysses sequence parallelism (``training.sequenceParallel``): each sequence split over a group of ranks.

The ``sequence_parallel`` ranks of a group (contiguous ranks, DeepSpeed's ``parallel_state_sp``) train on the same
micro-batch (:func:`memfit_trainer.validation.config_data`), each on one contiguous chunk of every row's tokens
(:func:`shard`). Everything but attention is per token; DeepSpeed's ``UlyssesSPAttentionHF`` wraps the attention
kernel so that an all-to-all trades the sequence split for a head split around it (every rank attends over the
whole sequence with ``heads / sequence_parallel`` heads), and all-gathers the position ids the kernel needs
(:func:`prepare`).

Packed documents: on the CPU the kernel is :data:`SP_SDPA`, SDPA with the causal same-document mask rebuilt from
the gathered position ids (the mask ``transformers`` would build locally is for the chunk, and Ulysses drops it);
its name holds no "flash" (``transformers`` would take it for a Hub flash kernel). With flash attention the
kernel is flash itself, given the whole sequence's document boundaries. Eager attention (a materialised mask)
and flex attention (Ulysses rebuilds a causal-only block mask, losing the documents) are refused.

The loss (:func:`sequence_mean`): each rank computes its chunk's summed cross-entropy over the whole sequence's
target count, so the SP group's gradients *sum* to the unsplit model's, and the value returned is the sequence's
mean (the same on every rank of the group: the loop's logging, validation and NaN check are unchanged). The
engines then average over data-parallel ranks only: DeepSpeed divides the world's sum by ``world / sp`` when given
the groups as ``mpu`` (but for ZeRO-3's reduce-scatter, which divides by the world: the loss is scaled by sp for its
backward, ``memfit_trainer.deepspeed_engine.zero3_sequence_scale``); FSDP2 is told that divide factor. Not
DeepSpeed's ``UlyssesSPDataLoaderAdapter`` (it consumes one loader batch per ``sp`` micro-steps, which breaks the
data position arithmetic of a resume) nor its ``TiledFusedLogitsLoss`` (its head gradient ignores any scaling of
the loss).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from memfit.api.vocabulary import ATTN_IMPLEMENTATION, Attention, Method
from memfit.contract.trainer_config import TrainerConfig
from memfit_trainer.blocks import IGNORE_INDEX
from memfit_trainer.chunked_loss import GROUP_TARGETS, SHIFT_LABELS, shift_labels
from memfit_trainer.data import flash_varlen_kwargs
from memfit_trainer.run import Run
from memfit_trainer.technique import Batch, BatchLoss, Installed

SP_SDPA = "memfit_sdpa_documents"
"""The attention kernel of SDPA under sequence parallelism (registered with ``transformers`` by
:func:`attn_implementation`)."""
CORE: dict[Attention, str] = {Attention.SDPA: SP_SDPA, Attention.FLASH: ATTN_IMPLEMENTATION[Attention.FLASH]}
"""The kernel Ulysses wraps, for each attention it can split."""
FLASH_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
"""The documents' boundaries a flash batch carries (:func:`~memfit_trainer.data.flash_varlen_kwargs`)."""


def config_problems(config: TrainerConfig) -> list[str]:
    """What sequence parallelism cannot run with, from the config alone (the heads: :func:`heads_problem`)."""
    training, sp = config.training, config.training.sequence_parallel
    if sp == 1:
        return []
    said = f"training.sequenceParallel {sp}"
    problems = []
    if training.attention not in CORE:
        problems.append(
            f"{said} needs sdpa or flash attention, not {training.attention.value} (eager materialises the whole "
            "sequence's mask; flex's rebuilt mask would let packed documents attend to one another)"
        )
    if config.engine.optimizer_in_backward:
        problems.append(f"{said}: optimizerInBackward averages each gradient over every rank, not the data ranks")
    if training.method == Method.QLORA:
        problems.append(f"{said} is not supported with qlora")
    return problems


def heads_problem(sequence_parallel: int, hf_config: Any) -> str | None:
    """One line when the model's attention heads do not split over ``sequence_parallel`` ranks (Ulysses gives
    each rank ``heads / sp`` query heads, and ``kv / sp`` key-value heads or, fewer than ranks, replicates them)."""
    if sequence_parallel == 1:
        return None
    text = hf_config.get_text_config()
    heads, kv = text.num_attention_heads, getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    if heads % sequence_parallel == 0 and (kv % sequence_parallel == 0 or sequence_parallel % kv == 0):
        return None
    return (
        f"training.sequenceParallel {sequence_parallel} does not split the model's {heads} attention heads and "
        f"{kv} key-value heads (heads must be a multiple of it, key-value heads a multiple or a divisor)"
    )


def attn_implementation(attention: Attention, sequence_parallel: int) -> str | None:
    """``transformers``' ``attn_implementation`` under sequence parallelism (None without: the plain one);
    :data:`SP_SDPA` is registered here, before any model is built with it."""
    if sequence_parallel == 1 or attention != Attention.SDPA:
        return None
    from transformers import AttentionInterface

    AttentionInterface.register(SP_SDPA, _sdpa_with_documents)
    return SP_SDPA


class _DocumentMask:
    """The causal same-document mask of the last gathered position ids: every layer's attention (and its
    recompute) of one forward gets equal ones, so the ``b x s x s`` mask is built once."""

    def __init__(self) -> None:
        self.positions: torch.Tensor | None = None
        self.mask: torch.Tensor | None = None

    def __call__(self, positions: torch.Tensor) -> torch.Tensor:
        if self.mask is None or self.positions is None or not _same(self.positions, positions):
            document = (positions == 0).cumsum(-1)
            s = positions.shape[-1]
            causal = torch.ones(s, s, dtype=torch.bool, device=positions.device).tril()
            self.positions, self.mask = positions, ((document[:, :, None] == document[:, None, :]) & causal)[:, None]
        return self.mask


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.device == b.device and bool(torch.equal(a, b))


_document_mask = _DocumentMask()


def _sdpa_with_documents(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """SDPA over the whole (gathered) sequence, each token attending causally within its document."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    assert position_ids is not None, "Ulysses passes the gathered position ids"
    return sdpa_attention_forward(module, query, key, value, _document_mask(position_ids), **kwargs)


def _release(core: str) -> None:
    """Undo an earlier :func:`prepare` of this process (the tests prepare more than once): DeepSpeed's groups are
    global state, and ``register_with_transformers`` overrides the kernel's entry with a wrapper of itself."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    parallel_state_sp._release_sequence_parallel_groups()
    with contextlib.suppress(KeyError):  # none: not prepared before
        # The local override; the registered kernel stays. (transformers' interface is unannotated.)
        del ALL_ATTENTION_FUNCTIONS[core]  # type: ignore[no-untyped-call]


def prepare(config: TrainerConfig, model: torch.nn.Module) -> Any:
    """Collective, before the engine's own setup: the sequence-parallel groups and the Ulysses attention over
    ``model``'s kernel; DeepSpeed's ``parallel_state_sp`` (the ``mpu`` of ``deepspeed.initialize``), None
    without sequence parallelism."""
    training = config.training
    if training.sequence_parallel == 1:
        return None
    import deepspeed
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")  # over torch's group
    core = CORE[training.attention]  # others refused (config_problems)
    _release(core)
    return UlyssesSPAttentionHF.register_with_transformers(
        model, core, training.sequence_parallel, training.micro_batch_size, seq_length_is_variable=True
    )


def shard(batch: Batch, rank: int, sequence_parallel: int) -> Batch:
    """Rank ``rank``'s chunk of the group's micro-batch ``batch`` (``input_ids``, ``labels`` and ``position_ids``
    or, unpacked, a right-padding ``attention_mask``, all ``b x s``).

    The rows are padded to a multiple of ``sequence_parallel`` (ignored labels at the end, which causal attention
    never lets earlier tokens see) and the labels shifted *before* slicing (a chunk's last token predicts the next
    chunk's first) into ``shift_labels``; ``labels`` is the same chunk (``transformers``' loss needs some labels and
    reads ``shift_labels``). Unpacked rows get positions counting from 0 and lose their mask: padding is on the
    right, where causal attention hides it already. Flash's document boundaries describe the whole padded
    sequence. :data:`GROUP_TARGETS` is the whole micro-batch's target count, which the chunk's summed loss is
    divided by."""
    ids, labels = batch["input_ids"], batch["labels"]
    rows, length = ids.shape
    positions = batch.get("position_ids")
    if positions is None:
        positions = torch.arange(length, device=ids.device).expand(rows, length)
    padding = -length % sequence_parallel
    if padding:
        after = positions[:, -1:] + torch.arange(1, padding + 1, device=ids.device)  # the last document goes on
        positions = torch.cat([positions, after], dim=1)
        ids = F.pad(ids, (0, padding), value=0)
        labels = F.pad(labels, (0, padding), value=IGNORE_INDEX)
    shifted = shift_labels(labels)
    chunk = (length + padding) // sequence_parallel
    part = slice(rank * chunk, (rank + 1) * chunk)
    kept = {name: value for name, value in batch.items() if name not in ("attention_mask", *FLASH_KEYS)}
    targets = shifted[:, part].contiguous()  # transformers' loss views it flat
    sharded: Batch = {
        **kept,
        "input_ids": ids[:, part].contiguous(),
        "position_ids": positions[:, part].contiguous(),
        "labels": targets,
        SHIFT_LABELS: targets,
        GROUP_TARGETS: (shifted != IGNORE_INDEX).sum().clamp(min=1),
    }
    if FLASH_KEYS[0] in batch:
        sharded.update(flash_varlen_kwargs(positions))
    return sharded


def sequence_mean(local: torch.Tensor, group: Any) -> torch.Tensor:
    """``local`` (this rank's chunk's share of its sequence's mean loss), valued at the group's sum, the mean:
    its gradient stays the share's, so that the group's gradients sum to the unsplit model's."""
    total = local.detach().clone()
    dist.all_reduce(total, group=group)
    return local + (total - local.detach())


def install(run: Run) -> Installed | None:
    """With ``training.sequenceParallel`` above 1, every micro-batch's loss of this rank's chunk, valued at the
    sequence's mean (the groups and the attention were set up by the engine's build: :func:`prepare`)."""
    training = run.config.training
    sp = training.sequence_parallel
    if sp == 1:
        return None
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    group, rank = parallel_state_sp.get_sequence_parallel_group(), parallel_state_sp.get_sequence_parallel_rank()

    def around(loss_of: BatchLoss) -> BatchLoss:
        return lambda batch: sequence_mean(loss_of(shard(batch, rank, sp)), group)

    return Installed(
        said=f"sequence parallel: each sequence split over {sp} ranks (Ulysses, {CORE[training.attention]} attention)",
        around=around,
    )
