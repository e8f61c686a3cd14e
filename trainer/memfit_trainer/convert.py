"""Resume after a re-plan to another checkpoint layout: convert the newest checkpoint another layout wrote.

Checkpoints are kept per layout (memfit.contract.layout). Rank 0 looks in the sibling layout directories for
the newest complete checkpoint, newer than this layout's newest, that
:meth:`~memfit.contract.layout.CheckpointLayout.converts_to` this run's layout, and converts it with DeepSpeed's
universal checkpoint (``deepspeed.checkpoint.ds_to_universal``: one full fp32 tensor per parameter and per
optimizer state, ``zero/<name>/fp32.pt``, ``exp_avg.pt``, ... and the step) into a scratch directory
``step-NNNNNN.universal.tmp`` of this run's layout (removed, like a torn save, by
:meth:`~memfit_trainer.checkpoint.CheckpointManager.cleanup_stale`). The run's engine loads it:

* DeepSpeed with ``checkpoint.load_universal`` (:func:`~memfit_trainer.deepspeed_engine.universal_loading`),
  which re-partitions every state for this stage and world size and restores the LR schedule from the copied
  model-states file (renamed, and for ZeRO-3 the optimizer's common state completed, where the source's stage
  wrote them otherwise);
* fsdp2 (:func:`load_universal_into_fsdp2`) through ``set_state_dict`` with full state dicts, the optimizer's
  states matched by name and the LR schedule loaded from DeepSpeed's model-states file.

The loop then saves the loaded state as this layout's checkpoint of the same step (the ordinary protocol,
its marker recording ``convertedFrom``), so the conversion happens once; the source is only read.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch.optim.lr_scheduler import LambdaLR

from memfit.contract.layout import CheckpointLayout
from memfit_trainer.checkpoint import TEMP_SUFFIX, Checkpoint, CheckpointManager, step_name
from memfit_trainer.optimizer_in_backward import PerParameterSchedules

UNIVERSAL_SUFFIX = ".universal" + TEMP_SUFFIX
MODEL_STATES = "mp_rank_00_model_states.pt"


class ConversionError(RuntimeError):
    """A checkpoint that should convert does not (its files disagree with this run's model or optimizer)."""


@dataclass(frozen=True)
class Conversion:
    """A checkpoint of another layout that converts into this run's."""

    source: Checkpoint
    layout: CheckpointLayout

    def marker(self) -> dict[str, Any]:
        """What the converted checkpoint's marker records of where it came from."""
        return {"layout": self.layout.to_dict(), "step": self.source.step, "directory": self.layout.directory_name}

    def describe(self) -> str:
        return f"converted from {self.layout.directory_name}/{self.source.path.name}"


@dataclass(frozen=True)
class Search:
    """Rank 0's finding: the conversion to make, and one line on a newer checkpoint that cannot be converted."""

    conversion: Conversion | None
    refusal: str | None


def _recorded_layout(checkpoint: Checkpoint) -> CheckpointLayout | None:
    recorded = checkpoint.marker.get("layout")
    if not isinstance(recorded, dict):
        return None  # written before layouts were recorded: what it holds is unknown
    try:
        return CheckpointLayout.from_dict(recorded)
    except ValueError:
        return None


def find_conversion(own: Path, target: CheckpointLayout, newer_than: int) -> Search:
    """The newest complete checkpoint (by step) after step ``newer_than`` (-1: any) in the directories next to
    ``own`` whose recorded layout converts to ``target``; where a newer one (or the only ones) cannot, the line
    that says why."""
    candidates = [
        (checkpoint, layout)
        for directory in sorted(own.parent.iterdir() if own.parent.is_dir() else [])
        if directory.is_dir() and directory != own
        for checkpoint in CheckpointManager(directory).complete()
        if checkpoint.step > newer_than and (layout := _recorded_layout(checkpoint)) is not None
    ]
    refusal = None
    for checkpoint, layout in sorted(candidates, key=lambda found: found[0].step, reverse=True):
        reason = layout.converts_to(target)
        if reason is None:
            return Search(Conversion(checkpoint, layout), refusal)
        if refusal is None:
            refusal = (
                f"a conversion from {layout.directory_name} to {target.directory_name} does not exist ({reason}): "
                f"its checkpoint step {checkpoint.step} is not used"
            )
    return Search(None, refusal)


def universal_dir(manager: CheckpointManager, step: int) -> Path:
    """The scratch directory the universal checkpoint of ``step`` is written to (temporary by its name)."""
    return manager.root / (step_name(step) + UNIVERSAL_SUFFIX)


def _fit_optimizer_state(zero: Path, partitioned_weights: bool) -> None:
    """ZeRO-3 loads a universal checkpoint's step and hyperparameters from the base optimizer's state dict
    (``optimizer_state_dict``), which ``ds_to_universal`` writes only from a ZeRO-3 source: from a ZeRO-1/2
    one it is built here of the per-parameter step and the saved parameter groups."""
    path = zero / "optimizer_state.pt"
    saved = torch.load(path, weights_only=False)  # DeepSpeed's own file: plain Python values and tensors
    if not partitioned_weights or "optimizer_state_dict" in saved:
        return
    steps = sorted(zero.glob("*/step.pt"))
    if not steps:
        raise ConversionError(f"no optimizer step in {zero}: the source checkpoint holds no optimizer state")
    step = torch.load(steps[0], weights_only=False)
    saved["optimizer_state_dict"] = {"state": {0: {"step": step}}, "param_groups": saved["param_groups"]}
    torch.save(saved, path)


def _name_model_states(root: Path, partitioned_weights: bool) -> None:
    """DeepSpeed loads a universal checkpoint's LR schedule and step counters from the model-states file it
    names by this run's stage (``zero_pp_rank_0_mp_rank_00_model_states.pt`` under ZeRO-3, else
    ``mp_rank_00_model_states.pt``); the converter copied the source stage's (the weights come from ``zero/``)."""
    wanted = root / f"{'zero_pp_rank_0_' if partitioned_weights else ''}{MODEL_STATES}"
    copied = sorted(root.glob("*model_states.pt"))
    if not copied:
        raise ConversionError(f"no model-states file (LR schedule) in {root}")
    if not wanted.exists():
        copied[0].rename(wanted)


def write_universal(source: Checkpoint, tag: str, scratch: Path, partitioned_weights: bool) -> Path:
    """Rank 0: DeepSpeed's universal checkpoint of ``source`` into ``scratch/<tag>`` (in this process: no
    worker pool; its progress output kept back unless it fails), its model-states file named for this run
    (``partitioned_weights``: DeepSpeed ZeRO-3); the directory to load with ``tag``."""
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    if scratch.exists():
        shutil.rmtree(scratch)
    scratch.mkdir(parents=True)
    arguments = argparse.Namespace(
        input_folder=str(source.path / tag),
        output_folder=str(scratch / tag),
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,  # models that name no universal-checkpoint patterns (all of ours)
    )
    said = io.StringIO()
    try:
        with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
            ds_to_universal(arguments)
    except Exception as error:  # DeepSpeed raises assertions and runtime errors alike
        raise ConversionError(
            f"DeepSpeed's universal conversion of {source.path} failed: {error!r}\n{said.getvalue()[-2000:]}"
        ) from error
    _name_model_states(scratch / tag, partitioned_weights)
    _fit_optimizer_state(scratch / tag / "zero", partitioned_weights)
    return scratch


def _read(zero: Path, name: str, state: str) -> Any:
    path = zero / name / f"{state}.pt"
    if not path.is_file():
        raise ConversionError(f"the universal checkpoint has no {state} of {name} ({path} missing)")
    return torch.load(path, weights_only=False)  # DeepSpeed's own files: plain Python values and tensors


def _step(zero: Path, name: str, common: dict[str, Any]) -> float:
    """The optimizer step of a parameter: its ``step.pt`` from a ZeRO-1/2 source, the base optimizer's state
    dict in ``optimizer_state.pt`` (``common``) from a ZeRO-3 one."""
    if (zero / name / "step.pt").is_file():
        return float(_read(zero, name, "step"))
    try:
        return float(common["optimizer_state_dict"]["state"][0]["step"])
    except (KeyError, IndexError, TypeError):
        raise ConversionError(f"the universal checkpoint in {zero} has no optimizer step of {name}") from None


def _tensor(zero: Path, name: str, state: str, like: torch.Tensor) -> torch.Tensor:
    """A parameter's state as full tensor of ``like``'s shape and dtype (a ZeRO-1/2 source stores it in a dict
    under ``param``, a ZeRO-3 one flat and bare)."""
    loaded = _read(zero, name, state)
    tensor = cast(torch.Tensor, loaded["param"] if isinstance(loaded, dict) else loaded)
    if tensor.numel() != like.shape.numel():
        raise ConversionError(f"{state} of {name}: {tuple(tensor.shape)} in the checkpoint, here {tuple(like.shape)}")
    return tensor.reshape(like.shape).to(like.dtype)


def _full_state(zero: Path, sharded: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The full model and optimizer state dicts of the universal checkpoint in ``zero``, shaped as this run's
    sharded optimizer state dict ``sharded`` (keyed by parameter name; a DTensor's shape is the full one; its
    dicts are the optimizer's own, so they are copied, never changed)."""
    model: dict[str, Any] = {}
    optimizer: dict[str, Any] = {"state": {}, "param_groups": []}
    common = torch.load(zero / "optimizer_state.pt", weights_only=False)
    for name, states in sharded["state"].items():
        full = optimizer["state"][name] = {}
        for state, value in states.items():
            if state == "step":
                full[state] = torch.tensor(_step(zero, name, common), dtype=value.dtype)
            else:
                full[state] = _tensor(zero, name, state, value)
                if name not in model:  # the weight once, shaped like any of its (full-shape) states
                    model[name] = _tensor(zero, name, "fp32", value)
    groups, here = common["param_groups"], sharded["param_groups"]
    if len(groups) not in (1, len(here)):  # one DeepSpeed group over all, or group for group
        raise ConversionError(f"{len(groups)} optimizer parameter group(s) in the checkpoint, here {len(here)}")
    for index, group in enumerate(here):
        saved = groups[index if len(groups) > 1 else 0]
        optimizer["param_groups"].append(
            {**group, **{key: saved[key] for key in ("lr", "initial_lr") if key in saved and key in group}}
        )
    return model, optimizer


def load_universal_into_fsdp2(
    module: torch.nn.Module,
    optimizers: tuple[torch.optim.Optimizer, ...],
    lr_scheduler: LambdaLR | PerParameterSchedules,
    universal: Path,
    tag: str,
    lora: bool,
) -> None:
    """Collective: the universal checkpoint's fp32 weights, optimizer states (matched by parameter name and
    state name, e.g. AdamW's ``exp_avg``) and LR into the fsdp2 engine's sharded ``module`` and ``optimizers``,
    and DeepSpeed's LambdaLR state into its ``lr_scheduler``. Every rank reads the full tensors into host
    memory (one model's weights and states at a time) and keeps its shard of each."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_state_dict

    sharded = StateDictOptions(ignore_frozen_params=lora, strict=not lora)
    # The template: its states initialised by torch (a step of zero gradients), keyed by parameter name.
    template: dict[str, Any] = dict(get_optimizer_state_dict(module, optimizers, options=sharded))
    root = universal / tag
    model, optimizer = _full_state(root / "zero", template)
    full = StateDictOptions(full_state_dict=True, ignore_frozen_params=lora, strict=not lora)
    set_state_dict(module, optimizers, model_state_dict=model, optim_state_dict=optimizer, options=full)
    model_states = torch.load(root / MODEL_STATES, weights_only=False)
    lr_scheduler.load_state_dict(model_states["lr_scheduler"])
