"""Tiled MLP (``memfit_trainer.tiled_mlp``): the same loss and gradients as the untiled model (full, LoRA,
checkpointed, offloaded), LoRA dropout's masks replayed in the recomputation, only the MLP's input saved, one
tile's intermediate tensors alive in backward; 2-rank runs on both engines train as the untiled ones do."""

from __future__ import annotations

import contextlib
import json
import weakref
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from memfit.contract.progress import read_progress
from memfit.contract.reader import ConfigError
from memfit.contract.trainer_config import TrainerConfig
from memfit.memory.activations import mlp_tile_tokens
from memfit.model_shape import ModelFamily, ModelShape
from memfit_trainer import activation_offload, tiled_mlp
from memfit_trainer.activation_offload import offload_activations
from memfit_trainer.hf_config import transformers_config
from memfit_trainer.tiled_mlp import dense_mlps, tile_mlps
from tests.trainer.runs import TINY_LLAMA, KilledRuns, make_config, run_held_and_killed, write_config

HIDDEN, INTERMEDIATE = 16, 48
TINY = ModelShape(ModelFamily.LLAMA, HIDDEN, INTERMEDIATE, 2, 4, 2, 97)
MIXTRAL = ModelShape(ModelFamily.MIXTRAL, HIDDEN, INTERMEDIATE, 2, 4, 2, 97, num_experts=4, experts_per_token=2)
BATCH, SEQUENCE = 2, 19  # 38 tokens: 3 tiles of 13, 13 and 12, across the two rows
TOLERANCE = 1e-5
"""Largest difference relative to the reference's largest magnitude (fp32: the tiles' sums differ in order)."""


def _model(lora: bool, checkpointing: bool = False, dropout: float = 0.0, tiled: bool = True) -> Any:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(transformers_config(TINY, use_cache=False), dtype=torch.float32)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora:
        from peft import LoraConfig, get_peft_model

        # B not zero: the adapters' dropout masks then reach every gradient
        adapters = LoraConfig(r=4, target_modules="all-linear", lora_dropout=dropout, init_lora_weights=False)
        model = get_peft_model(model, adapters)
    if tiled:
        assert len(tile_mlps(model)) == TINY.num_layers
    return model.train()


def _loss_and_gradients(model: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, TINY.vocab_size, (BATCH, SEQUENCE), generator=generator)
    torch.manual_seed(2)  # the same dropout masks in both models
    loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    gradients = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), gradients


def _assert_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys() and expected
    for name, want in expected.items():
        scale = want.abs().max().clamp(min=1e-12)
        assert (actual[name] - want).abs().max() / scale <= TOLERANCE, name


def test_tiles_hold_at_most_the_width_in_tokens() -> None:
    assert mlp_tile_tokens(38, 16) == 13  # 3 tiles: 13, 13, 12
    assert mlp_tile_tokens(16, 16) == 16
    assert mlp_tile_tokens(17, 16) == 9
    assert mlp_tile_tokens(5, 16) == 5
    assert all(mlp_tile_tokens(t, 64) <= 64 for t in range(1, 1000))


@pytest.mark.parametrize("setup", ["plain", "checkpointing", "checkpointing+offload"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_loss_and_gradients_equal_the_untiled_model(lora: bool, setup: str) -> None:
    checkpointing = setup != "plain"
    expected_loss, expected = _loss_and_gradients(_model(lora, checkpointing, tiled=False))
    model = _model(lora, checkpointing)
    with offload_activations(model) if setup.endswith("offload") else contextlib.nullcontext():
        loss, gradients = _loss_and_gradients(model)
    assert torch.allclose(loss, expected_loss, rtol=1e-6)
    _assert_close(gradients, expected)
    assert not lora or all(".lora_" in name for name in gradients)


def _tiles_with_a_graph(model: Any) -> None:
    """The reference for dropout: each MLP on the same tiles in the same order, but kept in the graph (no
    recomputation), so its gradient is that of the masks its forward drew."""
    for mlp in dense_mlps(model):
        forward = mlp.forward

        def tiles(x: torch.Tensor, forward: Callable[[torch.Tensor], torch.Tensor] = forward) -> torch.Tensor:
            flat = x.reshape(-1, x.shape[-1])
            tile = mlp_tile_tokens(flat.shape[0], x.shape[-1])
            parts = [forward(flat[start : start + tile]) for start in range(0, flat.shape[0], tile)]
            return torch.cat(parts).view(*x.shape[:-1], -1)

        mlp.forward = tiles


@pytest.mark.parametrize("checkpointing", [False, True], ids=["", "checkpointing"])
def test_lora_dropout_draws_the_same_masks_in_the_recomputation(
    checkpointing: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    reference = _model(lora=True, checkpointing=checkpointing, dropout=0.5, tiled=False)
    _tiles_with_a_graph(reference)
    expected_loss, expected = _loss_and_gradients(reference)
    loss, gradients = _loss_and_gradients(_model(lora=True, checkpointing=checkpointing, dropout=0.5))
    after_tiled = torch.get_rng_state()
    assert torch.allclose(loss, expected_loss, rtol=1e-6)
    _assert_close(gradients, expected)
    _loss_and_gradients(reference)
    assert torch.equal(after_tiled, torch.get_rng_state()), "the replays must give the global random state back"

    monkeypatch.setattr(tiled_mlp, "_replaying", lambda *_: contextlib.nullcontext())
    _, unreplayed = _loss_and_gradients(_model(lora=True, checkpointing=checkpointing, dropout=0.5))
    mlp_adapter = next(name for name in expected if ".mlp.down_proj.lora_A" in name)
    assert not torch.allclose(unreplayed[mlp_adapter], expected[mlp_adapter]), "the test would not see it"


def test_batch_rows_share_tiles_and_moe_blocks_are_left_alone() -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(transformers_config(MIXTRAL, use_cache=False))
    assert dense_mlps(model) == []
    mlp = _model(lora=False).model.layers[0].mlp
    x = torch.randn(3, 5, HIDDEN)  # 15 tokens: one tile of 15 over three rows
    assert torch.allclose(mlp(x), type(mlp).forward(mlp, x), atol=1e-6)


def saved_by(module: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """What autograd saves of ``module(x)``'s forward, once per storage, parameters left out."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    saved: dict[int, torch.Tensor] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        pointer = tensor.untyped_storage().data_ptr()
        if pointer not in params:
            saved.setdefault(pointer, tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        module(x)
    return list(saved.values())


class _Allocations(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch's __init_subclass__ is unannotated
    """The bytes of the storages ops create while it is entered, alive now and at most (torch keeps one Python
    object per storage while it lives: its finalizer marks the free)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # unannotated in torch
        self.live = self.peak = 0
        self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if any(result.alias_info is not None for result in func._schema.returns):
            return out  # a view or an in-place op: nothing allocated
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor) and tensor.untyped_storage() not in self._seen:
                storage = tensor.untyped_storage()
                self._seen[storage] = True  # type: ignore[no-untyped-call]  # unannotated in torch
                self.live += storage.nbytes()
                weakref.finalize(storage, self._free, storage.nbytes())
        self.peak = max(self.peak, self.live)
        return out

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes


def backward_peak(module: torch.nn.Module, x: torch.Tensor) -> int:
    """Bytes the backward of ``module(x)`` allocates and holds at its peak (gradients included), beyond what is
    alive when it starts (the forward's saved tensors, the output and its gradient)."""
    output = module(x)
    gradient = torch.ones_like(output)
    with _Allocations() as allocations:
        output.backward(gradient)
    return allocations.peak


MEMORY_TOKENS = 200
"""Tokens for the memory checks: 13 tiles of at most 16 tokens (tile 16, the last 8)."""


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_the_tiled_mlp_saves_only_its_input(lora: bool) -> None:
    x = torch.randn(1, MEMORY_TOKENS, HIDDEN, requires_grad=True)
    untiled = _model(lora, tiled=False).get_decoder().layers[0].mlp
    assert any(t.shape[-1] == INTERMEDIATE for t in saved_by(untiled, x))
    saved = saved_by(_model(lora).get_decoder().layers[0].mlp, x)
    assert [t.untyped_storage().data_ptr() for t in saved] == [x.untyped_storage().data_ptr()]
    assert saved[0].untyped_storage().nbytes() == MEMORY_TOKENS * HIDDEN * 4


def test_the_backward_holds_one_tiles_intermediate_tensors() -> None:
    """Tiled, the backward holds the input's gradient (t x h), the weights' gradients (3 x h x i) and, for one
    tile of T tokens, the recomputed intermediate tensors (gate and up projections, activation, product: 4 x T x
    i), two of their gradients (2 x T x i) and the tile's output (T x h): the memory model's terms, exactly."""
    x = torch.randn(1, MEMORY_TOKENS, HIDDEN, requires_grad=True)
    tile, fp32 = mlp_tile_tokens(MEMORY_TOKENS, HIDDEN), 4
    tiled = backward_peak(_model(lora=False).get_decoder().layers[0].mlp, x)
    held = MEMORY_TOKENS * HIDDEN + 3 * HIDDEN * INTERMEDIATE
    assert tiled == (held + 6 * tile * INTERMEDIATE + tile * HIDDEN) * fp32
    assert tiled < backward_peak(_model(lora=False, tiled=False).get_decoder().layers[0].mlp, x)


def test_install_says_what_it_tiles_and_refuses_a_model_without_dense_mlps(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    config = _tiled_config(make_config(tmp_path))
    run = SimpleNamespace(config=config, engine=SimpleNamespace(module=_model(lora=False, tiled=False)))
    installed = tiled_mlp.install(run)  # type: ignore[arg-type]
    assert installed is not None
    assert installed.said == "tiled MLP: 2 decoder MLPs run tiles of at most 16 tokens, recomputed in backward"
    assert tiled_mlp.install(SimpleNamespace(config=make_config(tmp_path))) is None  # type: ignore[arg-type]
    moe = AutoModelForCausalLM.from_config(transformers_config(MIXTRAL, use_cache=False))
    with pytest.raises(ConfigError, match="has none"):
        tiled_mlp.install(SimpleNamespace(config=config, engine=SimpleNamespace(module=moe)))  # type: ignore[arg-type]


def _engine_step(config: TrainerConfig, rank: int) -> tuple[float, float]:
    """One optimizer step of the config's engine on this rank's fixed batch, tiled and offloaded by the
    techniques' ``install`` where the config asks: the loss and the gradient norm."""
    from memfit_trainer.engine import build_engine
    from memfit_trainer.model import build_model
    from memfit_trainer.run import Ranks, Run

    torch.manual_seed(0)
    engine = build_engine(config, build_model(config).model, 10)
    run = Run(config, Ranks(rank, rank, 2), engine, None, None)  # type: ignore[arg-type]
    for install in (activation_offload.install, tiled_mlp.install):
        install(run)
    generator = torch.Generator().manual_seed(rank)
    shape = (config.training.micro_batch_size, config.training.sequence_length)
    batch = torch.randint(0, TINY_LLAMA.vocab_size, shape, generator=generator)
    loss = engine(input_ids=batch, labels=batch).loss
    engine.backward(loss)
    engine.step()
    assert engine.last_grad_norm is not None
    return loss.item(), engine.last_grad_norm


ENGINES: dict[str, dict[str, Any]] = {
    "deepspeed zero2": dict(stage=2, offload=False),
    "deepspeed zero3": dict(stage=3, offload=False),
    "deepspeed zero3 checkpointed offloaded": dict(stage=3, offload=False, activation_offloading=True),
    "fsdp2": dict(engine="fsdp2", stage=3, offload=False),
    "fsdp2 checkpointed offloaded": dict(engine="fsdp2", stage=3, offload=False, activation_offloading=True),
}


def _rank(rank: int, directory: Path) -> None:
    """One of two gloo ranks: every engine and method, untiled then tiled; the steps' losses and norms as JSON."""
    import os

    import deepspeed
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2")  # as torchrun sets them
    dist.init_process_group("gloo", init_method=f"file://{directory / 'store'}", rank=rank, world_size=2)
    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(1)
    results = {}
    try:
        for engine, options in ENGINES.items():
            for method in ("full", "lora"):
                own = directory / f"rank{rank}" / f"{engine}-{method}".replace(" ", "-")  # make_config writes a corpus
                own.mkdir(parents=True)
                config = make_config(own, method=method, **options)
                results[f"{engine} {method}"] = [_engine_step(c, rank) for c in (config, _tiled_config(config))]
        (directory / f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_an_engine_step_on_two_ranks_equals_the_untiled_one(tmp_path: Path) -> None:
    """Two gloo ranks in one spawn: DeepSpeed's ZeRO reduces each gradient once (``ds_grad_is_ready``: ZeRO-2
    asserts that no gradient is reduced twice; ZeRO-3 gathers the weights per tile) and FSDP2 reduce-scatters
    what the nested backward accumulated; bf16 compute, so the tiles' sums round differently."""
    mp.start_processes(_rank, args=(tmp_path,), nprocs=2, start_method="spawn")  # type: ignore[no-untyped-call]
    for rank in range(2):
        for case, (untiled, tiled) in json.loads((tmp_path / f"rank{rank}.json").read_text()).items():
            print(rank, case, "untiled loss, norm", untiled, "tiled", tiled)
            assert tiled[0] == pytest.approx(untiled[0], rel=1e-5), (rank, case)
            assert tiled[1] == pytest.approx(untiled[1], rel=1e-4), (rank, case)


def _tiled_config(config: TrainerConfig) -> TrainerConfig:
    document = config.model_dump(by_alias=True)
    document["training"]["tiledMlp"] = True
    return TrainerConfig.model_validate(document)


# --- memfit-train end to end ---------------------------------------------------------------------------


@pytest.mark.distributed
def test_a_run_trains_as_the_untiled_one(tmp_path: Path, killed_runs: KilledRuns) -> None:
    """Held after the same step as the untiled run that ``killed_runs`` shares (the one of
    ``test_resume_across_layouts``, DeepSpeed ZeRO-2 with CPU Adam: one start of memfit-train here when both run
    in one session): the same loss there, within bf16's rounding of the tiles' sums. (fsdp2 on two ranks:
    :func:`test_an_engine_step_on_two_ranks_equals_the_untiled_one`; end to end with sequence parallelism:
    tests/test_cli_run_long_context.py.)"""
    from tests.trainer.test_resume_across_layouts import EVERY, KILLED_AT, STEPS

    options: dict[str, Any] = dict(stage=2, max_steps=STEPS, checkpoint_every=EVERY, name="trip")
    untiled = killed_runs.copy(tmp_path / "untiled", KILLED_AT, **options)
    (tmp_path / "tiled").mkdir()
    tiled = _tiled_config(make_config(tmp_path / "tiled", **options))
    log = run_held_and_killed(tiled, write_config(tiled, tmp_path / "tiled" / "config.json"), KILLED_AT)
    assert "tiled MLP: 2 decoder MLPs run tiles of at most 64 tokens, recomputed in backward" in log
    expected, actual = (read_progress(c.metrics.progress_file) for c in (untiled, tiled))  # type: ignore[arg-type]
    assert expected is not None and actual is not None and actual.step == expected.step == KILLED_AT
    print("loss at step", KILLED_AT, "untiled", expected.loss, "tiled", actual.loss)
    assert actual.loss == pytest.approx(expected.loss, rel=1e-3)
