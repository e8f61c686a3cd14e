"""Check what a config asks for against this machine before any GPU work.

A pod that would fail ten minutes in (after loading a 70B model) because of a missing package, an
unsupported precision or an unwritable NVMe path should instead fail at once with one clear line. Every
problem found is reported together, as one :class:`~memfit.contract.trainer_config.ConfigError`.

The config itself was checked when it was read (``load_config``); here it meets the machine: the ranks
started, installed packages, the accelerator, the files. Where the config names the job's volumes, the data,
the output directory (and the checkpoint and final directories in it) and a model directory must stay
inside their volume once symlinks are resolved: a symlink on a volume must not send checkpoints to the
pod's ephemeral disk. Nothing is created outside its volume.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from pathlib import Path

from memfit.api.vocabulary import (
    BYTE_TOKENIZER_VOCAB,
    EIGHT_BIT_OPTIMIZERS,
    Attention,
    Devices,
    Engine,
    Method,
    Optimizer,
    Precision,
)
from memfit.contract.engines import DeepSpeedEngineSection
from memfit.contract.model_match import model_directory_problem
from memfit.contract.reader import ConfigError
from memfit.contract.trainer_config import TrainerConfig

"""Token ids the byte-level tokenizer of random-init models emits (256 bytes, EOS, pad)."""
NEEDS_BITSANDBYTES = EIGHT_BIT_OPTIMIZERS | {Optimizer.LION}
"""Client optimizers (those the DeepSpeed section does not build) that come from bitsandbytes."""


def _writable_dir(path: Path) -> bool:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(path, os.W_OK | os.X_OK)


def _escape(path: str | Path, root: str) -> str | None:
    """Where ``path`` really leads if that is outside ``root`` (both with symlinks resolved), else None."""
    real, real_root = os.path.realpath(path), os.path.realpath(root)
    if real == real_root or real.startswith(real_root.rstrip("/") + "/"):
        return None
    return real


def _volume_problems(config: TrainerConfig) -> list[str]:
    volumes = config.volumes
    if volumes is None:
        return []
    checks: list[tuple[str, str | Path, str | None]] = [("data.path", config.data.path, volumes.data)]
    checks += [
        (name, path, volumes.output)
        for name, path in (
            ("outputDir", config.output_dir),
            ("the checkpoint directory", config.checkpoint_dir),
            ("the final directory", config.final_dir),
        )
    ]
    if volumes.model is not None:
        checks.append(("model.nameOrPath", config.model.name_or_path, volumes.model))
    if config.data.validation is not None and config.data.validation.path is not None:
        checks.append(("data.validation.path", config.data.validation.path, volumes.data))
    problems = []
    for name, path, root in checks:
        real = _escape(path, root) if root is not None else None
        if real is not None:
            problems.append(f"{name} {str(path)!r} leads to {real!r}, outside its volume {root!r} (a symlink?)")
    return problems


def _metrics_port_problem(config: TrainerConfig, environ: Mapping[str, str]) -> str | None:
    port = config.metrics.port
    local = environ.get("LOCAL_WORLD_SIZE", "1")
    local_ranks = int(local) if local.isdigit() and int(local) > 0 else 1
    if port and port + local_ranks - 1 > 65535:
        return f"metrics.port {port} + {local_ranks - 1} (rank r serves port + local rank) is beyond 65535"
    return None


def _flex_problem(config: TrainerConfig) -> str | None:
    """Flex attention trains only on CUDA (torch 2.13 refuses its backward on the CPU), through Triton kernels
    that ``torch.compile`` generates: said at start, not at the first backward pass."""
    if config.training.attention != Attention.FLEX:
        return None
    if config.devices != Devices.CUDA:
        return (
            "training.attention flex: torch's flex_attention has no backward pass on the CPU (it trains on CUDA "
            "GPUs only): set training.attention to sdpa"
        )
    if importlib.util.find_spec("triton") is None:
        return "training.attention flex: torch compiles flex_attention with Triton, which is not installed"
    return None


def _devices_problem(config: TrainerConfig) -> str | None:
    """A plan for GPUs where the container sees none (a node that advertises nvidia.com/gpu without a working
    device plugin or runtime): said at start-up, not trained on the CPU under the GPU plan's numbers."""
    if config.devices != Devices.CUDA:
        return None
    import torch

    if torch.cuda.is_available():
        return None
    return (
        "the plan is for NVIDIA GPUs but this container sees no CUDA device (torch.cuda.is_available() is "
        "False): the node's GPU device plugin or container runtime gives it none"
    )


def _has_flash_attention() -> bool:
    """Whether this machine has the flash-attn package (the CUDA trainer image builds it; a CPU one cannot)."""
    return importlib.util.find_spec("flash_attn") is not None


def _precision_problem(precision: Precision) -> str | None:
    if precision == Precision.FP32:
        return None
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    supported = accelerator.is_bf16_supported() if precision == Precision.BF16 else accelerator.is_fp16_supported()
    if supported:
        return None
    return f"training.precision {precision} is not supported by this machine's {accelerator.device_name()} accelerator"


def _offload_problems(config: TrainerConfig) -> list[str]:
    if not isinstance(config.engine, DeepSpeedEngineSection):
        return []
    problems = []
    for key, nvme in config.engine.nvme_paths.items():
        if not Path(nvme).is_dir():
            problems.append(f"deepspeed {key} uses NVMe but nvme_path {nvme!r} does not exist")
        elif not os.access(nvme, os.W_OK | os.X_OK):
            problems.append(f"deepspeed {key} uses NVMe but nvme_path {nvme!r} is not writable")
    return problems


def _fsdp2_problems(config: TrainerConfig) -> list[str]:
    """What the fsdp2 engine (memfit_trainer.fsdp2_engine) does not run, beyond what the config refuses."""
    if config.engine.kind != Engine.FSDP2:
        return []
    training, problems = config.training, []
    if training.precision == Precision.FP16:
        problems.append("engine fsdp2 trains in bf16 or fp32: fp16 needs loss scaling, which it does not do")
    if training.optimizer == Optimizer.LION:
        problems.append("optimizer lion (bitsandbytes) runs on the deepspeed engine, not on fsdp2's sharded tensors")
    return problems


def _model_problem(config: TrainerConfig) -> str | None:
    """A model directory that is missing, holds no config.json or another shape than the plan's (a Hub id's
    config is compared when it is fetched, at load: memfit_trainer.model.check_planned_shape)."""
    model, volumes = config.model, config.volumes
    name = model.name_or_path
    on_volume = volumes is not None and volumes.model is not None
    if model.random_init or not (on_volume or name.startswith(("/", "./", "../")) or Path(name).is_dir()):
        return None
    if volumes is not None and volumes.model is not None and _escape(name, volumes.model) is not None:
        return None  # reported as leading outside its volume; nothing is read there
    return model_directory_problem(name, model.architecture, model.planned_fields) or _model_class_problem(config)


def _model_class_problem(config: TrainerConfig) -> str | None:
    """A model directory's model class (from its config.json, as ``transformers`` resolves it) that cannot do
    what the config asks for (the attention kernel, packing), or that ``transformers`` does not have (a Hub
    model's and a randomInit model's are checked at load: memfit_trainer.model.check_model_class)."""
    from memfit_trainer.model import model_class_problem, pretrained_config

    try:
        return model_class_problem(config, pretrained_config(config.model))
    except ConfigError as error:  # a config transformers cannot read, or no causal LM for it
        return str(error)


def _sequence_parallel_problems(config: TrainerConfig) -> list[str]:
    """What sequence parallelism cannot run with (the heads' split is the model class's problem)."""
    from memfit_trainer.sequence_parallel import config_problems  # torch, only where the check runs

    return config_problems(config)


def check(config: TrainerConfig, environ: Mapping[str, str]) -> None:
    """Raise ConfigError naming every way ``config`` cannot run here."""
    training, data = config.training, config.data
    problems: list[str] = []
    world_size = int(environ.get("WORLD_SIZE", "1"))
    if world_size != config.world_size:
        problems.append(
            f"{world_size} rank(s) started but the plan is for {config.world_size} (globalBatchSize "
            f"{training.global_batch_size} = microBatchSize {training.micro_batch_size} x "
            f"gradientAccumulationSteps {training.gradient_accumulation_steps} x ranks)"
        )
    if sum(f is not None for f in (data.text_field, data.messages_field, data.prompt_field)) != 1 or (
        (data.prompt_field is None) != (data.completion_field is None)
    ):
        problems.append("data needs exactly one of textField, messagesField and promptField with completionField")
    volume_problems = _volume_problems(config)
    problems.extend(volume_problems)
    model = _model_problem(config)
    if model:
        problems.append(model)
    if not Path(data.path).exists():
        problems.append(f"data.path {data.path!r} does not exist")
    elif not (Path(data.path).is_file() or Path(data.path).is_dir()):
        problems.append(f"data.path {data.path!r} is neither a file nor a directory")
    if data.streaming and training.max_steps is None:
        problems.append("streaming data has no known epoch length: set training.maxSteps")
    architecture = config.model.architecture
    byte_tokenizer = config.model.random_init and config.model.tokenizer is None
    if byte_tokenizer and architecture is not None and architecture.vocab_size < BYTE_TOKENIZER_VOCAB:
        problems.append(
            f"model.architecture.vocabSize {architecture.vocab_size} is below the {BYTE_TOKENIZER_VOCAB} ids of "
            "the byte-level tokenizer random-init models use"
        )
    if training.attention == Attention.FLASH and not _has_flash_attention():
        problems.append("training.attention is flash but the flash-attn package is not installed")
    flex = _flex_problem(config)
    if flex:
        problems.append(flex)
    bnb_needed = training.method == Method.QLORA or (
        not config.engine.builds_optimizer and training.optimizer in NEEDS_BITSANDBYTES
    )
    if bnb_needed and importlib.util.find_spec("bitsandbytes") is None:
        problems.append(f"{training.method} with optimizer {training.optimizer} needs bitsandbytes, not installed")
    if training.method == Method.QLORA and training.precision != Precision.BF16:
        problems.append("qlora computes in bf16: set training.precision to bf16")
    problems.extend(_offload_problems(config))
    problems.extend(_fsdp2_problems(config))
    problems.extend(_sequence_parallel_problems(config))
    port = _metrics_port_problem(config, environ)
    if port:
        problems.append(port)
    if not volume_problems and not _writable_dir(Path(config.output_dir)):  # never create outside the volume
        problems.append(f"outputDir {config.output_dir!r} cannot be created or written")
    devices = _devices_problem(config)
    if devices:
        problems.append(devices)
    precision = None if devices else _precision_problem(training.precision)
    if precision:
        problems.append(precision)
    if problems:
        raise ConfigError("; ".join(problems))
