"""The FSDP2 engine's memory and throughput accounting (memfit/memory/engines/fsdp2.py), term by term."""

from __future__ import annotations

import dataclasses

import pytest

from memfit.api.gpupool import PoolCapacity
from memfit.api.plan import Strategy
from memfit.api.vocabulary import Attention, Engine, MasterWeights, Method, Offload, Optimizer, Precision
from memfit.catalog.models import MODEL_PRESETS
from memfit.memory.engines.fsdp2 import Fsdp2Step, fsdp2_groups, fsdp2_step
from memfit.memory.estimate import (
    activation_setup,
    host_memory_per_node,
    loaded_on_host,
    model_states,
    peak_memory,
    static_memory,
)
from memfit.memory.profiled_activations import model_activations
from memfit.memory.setup import Adapters, LoraSettings, StaticSetup
from memfit.memory.sizes import NF4_BYTES_PER_PARAMETER
from memfit.planner import throughput
from memfit.planner.engine import CPU_ADAM_PARAMS_PER_SECOND_PER_NODE
from memfit.planner.engines.fsdp2 import fsdp2_communication_bytes
from memfit.planner.search import lora_settings

SHAPE = MODEL_PRESETS["llama-2-7b"]
P = SHAPE.parameter_count
LORA = LoraSettings(Adapters(16, ("all-linear",)), True)


def fsdp2(gpus: int = 8, stage: int = 3, offload: Offload = Offload.NONE, **kw: object) -> Strategy:
    fields: dict[str, object] = dict(
        method=Method.FULL, pool="p", nodes=1, gpus_per_node=gpus, zero_stage=stage, offload_optimizer=offload,
        offload_parameters=offload, gradient_checkpointing=False, micro_batch_size=1, gradient_accumulation_steps=1,
        precision=Precision.BF16, optimizer=Optimizer.ADAMW, attention=Attention.SDPA, engine=Engine.FSDP2,
    )  # fmt: skip
    fields.update(kw)
    return Strategy(**fields)  # type: ignore[arg-type]


def states(strategy: Strategy):  # type: ignore[no-untyped-def]
    return model_states(SHAPE, strategy, LORA.adapters)


@pytest.mark.parametrize("gpus", [1, 2, 8, 64])
def test_full_fine_tuning_holds_sixteen_bytes_per_parameter_over_the_ranks(gpus: int) -> None:
    s = states(fsdp2(gpus))
    assert s.parameters == int(4 * P / gpus)  # fp32 shards
    assert s.gradients == int(4 * P / gpus)  # fp32 reduce-scatter output
    assert s.optimizer_states == int(8 * P / gpus)  # exp_avg, exp_avg_sq like the fp32 shard
    assert s.step_gradients == 0 and s.cpu_per_rank == 0


def test_bf16_masters_halve_every_sharded_state() -> None:
    fp32, bf16 = states(fsdp2()), states(fsdp2(master_weights=MasterWeights.BF16))
    assert bf16.parameters == int(2 * P / 8) and bf16.gradients == int(2 * P / 8)
    assert bf16.optimizer_states == int(4 * P / 8) == fp32.optimizer_states // 2


def test_lora_shards_the_bf16_base_and_the_adapters() -> None:
    s = states(fsdp2(method=Method.LORA))
    adapters = SHAPE.lora_parameters(LORA.adapters.rank, LORA.adapters.targets)
    assert s.parameters == int((2 * P + 4 * adapters) / 8)
    assert s.gradients == int(4 * adapters / 8) and s.optimizer_states == int(8 * adapters / 8)


def test_the_deepspeed_path_is_untouched() -> None:
    deepspeed = dataclasses.replace(fsdp2(), engine=Engine.DEEPSPEED)
    assert states(deepspeed) != states(fsdp2())
    assert states(deepspeed).parameters > states(fsdp2()).parameters // 2  # zero3: 2P/N + working set


def test_cpu_offload_moves_every_sharded_state_to_the_host() -> None:
    on_gpu, offloaded = states(fsdp2()), states(fsdp2(offload=Offload.CPU))
    assert (offloaded.parameters, offloaded.gradients, offloaded.optimizer_states) == (0, 0, 0)
    assert offloaded.cpu_per_rank == on_gpu.parameters + on_gpu.gradients + on_gpu.optimizer_states
    step = fsdp2_step(SHAPE, StaticSetup.of(fsdp2(offload=Offload.CPU)), LORA.adapters)
    assert step.layer_sharded_gradient == step.root_sharded_gradient == 0  # copied to the host when reduced
    gathered = fsdp2_step(SHAPE, StaticSetup.of(fsdp2()), LORA.adapters)
    assert step.root == gathered.root  # still gathered on the GPU
    static = static_memory(SHAPE, StaticSetup.of(fsdp2(offload=Offload.CPU)), LORA)
    assert static.cpu_per_node >= 8 * offloaded.cpu_per_rank


def _peak(strategy: Strategy, seq: int = 2048) -> tuple[int, int]:
    static = static_memory(SHAPE, StaticSetup.of(strategy), LORA)
    acts = model_activations(SHAPE, activation_setup(SHAPE, strategy, seq, LORA))
    memory = peak_memory(static, acts, strategy.gradient_accumulation_steps)
    assert memory.phases is not None
    return memory.per_gpu.peak_allocated_bytes, memory.phases.forward_backward.parameters


def test_keeping_parameters_gathered_holds_every_layer_at_the_loss() -> None:
    groups = fsdp2_groups(SHAPE, Method.FULL, LORA.adapters)
    keep, reshard = (fsdp2_step(SHAPE, StaticSetup.of(s), LORA.adapters) for s in (fsdp2(stage=2), fsdp2()))
    assert keep.layer == reshard.layer == 2 * groups.layer
    acts = model_activations(SHAPE, activation_setup(SHAPE, fsdp2(), 2048, LORA))
    at_loss_keep, at_loss_reshard = keep.moments(acts, False)[0], reshard.moments(acts, False)[0]
    assert at_loss_keep.parameters - at_loss_reshard.parameters == SHAPE.num_layers * 2 * groups.layer
    assert _peak(fsdp2(stage=2))[0] > _peak(fsdp2())[0]


def test_the_root_group_is_the_embedding_the_final_norm_and_the_head() -> None:
    g = fsdp2_groups(SHAPE, Method.FULL, LORA.adapters)
    assert g.root == 2 * SHAPE.vocab_size * SHAPE.hidden_size + SHAPE.hidden_size
    assert g.root + SHAPE.num_layers * g.layer == P
    lora = fsdp2_groups(SHAPE, Method.LORA, LORA.adapters)
    assert lora.root_trained == 0 and lora.layers * lora.layer_trained == SHAPE.lora_parameters(
        16, LORA.adapters.targets
    )


def test_the_roots_reduce_scatter_is_counted_at_the_end_of_the_backward() -> None:
    """fp32 reduction: the root's bf16 gradients and their fp32 reduce-scatter input, 6 bytes per root
    parameter, on top of every layer's sharded gradient."""
    step = fsdp2_step(SHAPE, StaticSetup.of(fsdp2()), LORA.adapters)
    g = fsdp2_groups(SHAPE, Method.FULL, LORA.adapters)
    acts = model_activations(SHAPE, activation_setup(SHAPE, fsdp2(), 1, LORA))
    end = step.moments(acts, False)[-1]
    assert end.gradients == 6 * g.root + SHAPE.num_layers * (4 * g.layer // 8)


def test_gradient_accumulation_keeps_every_sharded_gradient() -> None:
    one, four = _peak(fsdp2())[0], _peak(fsdp2(gradient_accumulation_steps=4))[0]
    assert four > one


def test_fsdp2_has_no_deepspeed_buckets_and_phases_add_up() -> None:
    static = static_memory(SHAPE, StaticSetup.of(fsdp2()), LORA)
    assert static.communication_buffers == 0 and isinstance(static.forward_backward, Fsdp2Step)
    acts = model_activations(SHAPE, activation_setup(SHAPE, fsdp2(), 2048, LORA))
    memory = peak_memory(static, acts, 1)
    from memfit.memory.estimate import step_total

    assert step_total(static, acts, 1) == memory.per_gpu.total


POOL = PoolCapacity(
    name="p", product="a100", gpu_memory_bytes=80 * 2**30, gpus_per_node=8, nodes=1,
    cpu_memory_bytes_per_node=2**40, nvme_bytes_per_node=0, nvme_bytes_per_second=3e9, bf16=True,
    peak_flops_bf16=312e12, peak_flops_fp16=312e12, intra_node_bytes_per_second=300e9,
    inter_node_bytes_per_second=25e9, pcie_bytes_per_second=25e9,
)  # fmt: skip


def test_fsdp2_communication_volume() -> None:
    """Per micro-batch: bf16 all-gathers of every parameter (forward, and backward when resharding; none for
    the recomputation, which runs with the layer gathered) and an fp32 reduce-scatter of the gradients."""
    ring = 7 / 8
    reshard = fsdp2_communication_bytes(SHAPE, fsdp2(gradient_checkpointing=True), P)
    assert reshard == pytest.approx(ring * (2 * 2 * P + 4 * P))
    keep = fsdp2_communication_bytes(SHAPE, fsdp2(stage=2, gradient_accumulation_steps=2), P)
    assert keep == pytest.approx(2 * ring * (2 * P + 4 * P))
    bf16 = fsdp2_communication_bytes(SHAPE, fsdp2(master_weights=MasterWeights.BF16), P)
    assert bf16 == pytest.approx(ring * (2 * 2 * P + 2 * P))


def test_fsdp2_offload_costs_pcie_and_the_cpu_optimizer() -> None:
    on_gpu = throughput.step_seconds(SHAPE, fsdp2(), POOL, 2048, P)
    offloaded = throughput.step_seconds(SHAPE, fsdp2(offload=Offload.CPU), POOL, 2048, P)
    pcie = (2 * 4 * P / 8 + 4 * P / 8) / POOL.pcie_bytes_per_second
    cpu_adam = P / 8 / (CPU_ADAM_PARAMS_PER_SECOND_PER_NODE / 8)
    assert offloaded - on_gpu == pytest.approx(pcie + cpu_adam)


def test_seventy_billion_qlora_fits_two_24_gb_gpus_only_sharded_by_fsdp2() -> None:
    """answer.ai's FSDP-QLoRA case: Llama 2 70B on 2 x RTX 4090 (128 GiB host: each rank builds its 4-bit
    model there before sharding, 2 x 37 GB). Its 4-bit base
    whole (35 GB) fits no 24 GB GPU, so DeepSpeed's QLoRA cannot; sharded, each rank holds half the packed
    codes plus every quant state (tests/trainer/test_fsdp2_qlora.py checks these terms against the real
    tensors of a sharded model), and the fastest plan moves its shards to the host, as answer.ai ran it."""
    from memfit.memory.engines.fsdp2 import packed_bytes, replicated_quant_states
    from memfit.memory.states import trainable_split
    from memfit.planner.search import plan_job
    from tests.planning_fixtures import job, pool

    shape = MODEL_PRESETS["llama-2-70b"]
    result = plan_job(job("llama-2-70b", batch=8, sequence=512), [pool("rtx", "NVIDIA-GeForce-RTX-4090", 2, 1, 128)])
    chosen = result.chosen
    assert chosen is not None and chosen.strategy.method == Method.QLORA and chosen.strategy.engine == Engine.FSDP2
    assert chosen.fits and chosen.memory.per_gpu.total <= chosen.gpu_memory_bytes
    s = chosen.strategy
    split = trainable_split(shape, Method.QLORA, LORA.adapters)
    assert s.master_weights == MasterWeights.FP32  # the adapters are fp32, the frozen base bf16
    sharded = split.frozen_unquantized * 2 + packed_bytes(split.frozen_quantized) + split.trainable * 4
    quant_states = replicated_quant_states(shape, Method.QLORA)
    assert s.offload_parameters == Offload.CPU
    on_the_gpus = dataclasses.replace(s, offload_optimizer=Offload.NONE, offload_parameters=Offload.NONE)
    assert model_states(shape, on_the_gpus, LORA.adapters).parameters == int(sharded / 2) + quant_states
    assert 2 * packed_bytes(shape.quantizable_parameters) > chosen.gpu_memory_bytes  # whole, it fits no GPU
    print(f"{s.summary()}: {chosen.memory.per_gpu}")


def test_every_fsdp2_rank_builds_its_model_on_the_host_before_sharding() -> None:
    """The trainer's FSDP2 path builds the whole model on each rank's host (no partitioned construction as
    under DeepSpeed ZeRO-3): 16-bit for full and LoRA, the 4-bit model for QLoRA."""
    deepspeed = fsdp2(engine=Engine.DEEPSPEED)
    assert loaded_on_host(SHAPE, StaticSetup.of(deepspeed)) == 0  # ZeRO-3 builds partitioned
    assert loaded_on_host(SHAPE, StaticSetup.of(fsdp2())) == 2 * P
    quantized = SHAPE.quantizable_parameters
    four_bit = loaded_on_host(SHAPE, StaticSetup.of(fsdp2(method=Method.QLORA)))
    assert four_bit == int(quantized * NF4_BYTES_PER_PARAMETER) + 2 * (P - quantized)
    assert loaded_on_host(SHAPE, StaticSetup.of(dataclasses.replace(deepspeed, method=Method.QLORA, zero_stage=2))) == 0
    cpu, _ = host_memory_per_node(SHAPE, StaticSetup.of(fsdp2()), states(fsdp2()))
    assert cpu >= 8 * 2 * P  # eight ranks, each with the 16-bit model


def test_static_memory_is_set_up_with_the_chunked_loss_it_reads() -> None:
    """fsdp2's forward-loss moment depends on chunked_loss: the planner's static-memory cache, keyed by the
    setup, must not serve one variant the other's (a hand-typed key once left chunked_loss out)."""
    plain, chunked = fsdp2(), fsdp2(chunked_loss=True)
    assert StaticSetup.of(plain) != StaticSetup.of(chunked)
    assert static_memory(SHAPE, StaticSetup.of(plain), LORA) != static_memory(SHAPE, StaticSetup.of(chunked), LORA)


def test_every_plan_of_a_chunked_loss_fsdp2_search_has_its_own_strategys_memory() -> None:
    """Each plan the planner reports, fitting or not, carries what its own strategy computes afresh."""
    from memfit.planner.search import plan_job
    from tests.plan_grid import INVENTORY
    from tests.planning_fixtures import job

    spec = job(
        "llama-3.2-3b",
        "full",
        training={"globalBatchSize": 16, "sequenceLength": 4096, "maxGradNorm": 0},
        strategy={"engine": "fsdp2"},
    )
    result = plan_job(spec, INVENTORY)
    shape = spec.planned_model()
    lora = lora_settings(spec, shape)
    plans = [*result.candidates, *result.rejected]
    assert any(p.strategy.chunked_loss for p in plans) and any(not p.strategy.chunked_loss for p in plans)
    for plan in plans:
        s = plan.strategy
        static = static_memory(shape, StaticSetup.of(s), lora)
        activations = model_activations(shape, activation_setup(shape, s, spec.training.sequence_length, lora))
        assert plan.memory == peak_memory(static, activations, s.gradient_accumulation_steps), s.summary()
