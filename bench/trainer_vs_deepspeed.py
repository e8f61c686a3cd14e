"""memfit-train's optimizer-step time against a bare loop of the same engine on the same model, in one run.

Run from the repository root (2 CPU ranks; DeepSpeed's CPU ops must be built, as for the trainer tests):

    DS_ACCELERATOR=cpu .venv/bin/python bench/trainer_vs_deepspeed.py [--engine both] [--steps 40] [--warmup 5]

For each engine (``--engine deepspeed``, ``fsdp2`` or ``both``, the default) a bare loop and the trainer run
under ``torchrun --nproc-per-node 2``, one after the other in this one invocation, on the same randomly
initialised llama (hidden 256, 4 layers, vocabulary 258 = the byte tokenizer, SDPA), with the same
precision, micro-batch (2 x 128 tokens per rank), clipping (1.0), constant learning rate for the bare loops
and number of steps. The engines' settings:

* deepspeed: one DeepSpeed config on both sides (ZeRO-2, DeepSpeed's AdamW, no offload); the trainer's
  config has ``engine: deepspeed``;
* fsdp2: ``fully_shard`` on each decoder layer, then the root, parameters kept gathered between forward and
  backward (``reshardAfterForward: false``, ZeRO-2 like), no offload, gradients reduced in fp32, torch's
  AdamW; the trainer's config has ``engine: fsdp2`` with that ``fsdp2`` section and no DeepSpeed section.

The two sides:

* bare: deepspeed: ``deepspeed.initialize`` (with a constant LambdaLR, as the trainer hands DeepSpeed a
  LambdaLR), then ``engine(input_ids=x, labels=x)`` / ``engine.backward`` / ``engine.step``; fsdp2: the
  model sharded as above (the trainer's dtype policy: bf16 compute over fp32 masters with ``--precision
  bf16``, plain fp32 by default), then ``model(input_ids=x, labels=x).loss.backward()`` /
  ``clip_grad_norm_`` / ``AdamW.step`` / ``zero_grad`` / a constant LambdaLR's step. Both run over random token
  batches made before the clock starts; each step is timed from its start to its end (with a CUDA
  synchronize where there is one). The model is built like the trainer's random init: same seed, so the
  same weights.
* trainer: ``memfit_trainer.main.main`` itself, unchanged, with a recorder on ``TrainerMetrics.step`` that
  keeps every ``step_seconds`` the trainer observes into ``memfit_train_step_duration_seconds`` (exact values,
  where the histogram's buckets would round them) and the time of each call. The recorded values are checked
  against the histogram's ``_sum`` and ``_count`` at the end. Two trainer rows are printed per engine: the
  histogram's own step time, and the step-to-step wall interval, which also covers what the loop does between
  steps (metrics, the progress file, the console line, the checkpoint-schedule check).

Start-up (imports, model building, sharding or ``deepspeed.initialize``, data packing) is outside every timed
step, and the first ``--warmup`` steps of each run are dropped. Checkpointing is excluded:
``checkpointEverySteps`` is beyond the run, so only the final save happens, after the last timed step. Times
are rank 0's. The machine is noisy, so only the side-by-side ratio (trainer over the same engine's bare loop)
means much; nothing here asserts a timing. ``--rounds 2`` runs bare, trainer, trainer, bare per engine (a
drift in the machine's speed then weighs on both sides alike) and pools the steps.

The default precision is fp32 (``--precision bf16`` for bf16 compute): CPUs without native bf16 matrix units
run bf16 matmuls about ten times slower than fp32, which would bury the loop's own cost under emulated
arithmetic and take minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memfit.api.vocabulary import ATTN_IMPLEMENTATION, Attention, Engine, Method, PlannedPrecision, Precision
from memfit.contract.engines import DeepSpeedEngineSection, Fsdp2EngineSection
from memfit.contract.sections import DataConfig, MetricsConfig, ModelConfig, TrainingConfig
from memfit.contract.trainer_config import TrainerConfig
from memfit.model_shape import ModelFamily, ModelShape

if TYPE_CHECKING:
    import torch

WORLD_SIZE = 2
MICRO_BATCH = 2
SEQUENCE_LENGTH = 128
LEARNING_RATE = 1e-3
ARCHITECTURE = ModelShape(
    family=ModelFamily.LLAMA,
    hidden_size=256,
    intermediate_size=688,
    num_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=258,
)
PRECISIONS: dict[str, PlannedPrecision] = {Precision.FP32.value: Precision.FP32, Precision.BF16.value: Precision.BF16}
"""The choices of --precision."""
ENGINES: dict[str, tuple[str, str]] = {
    Engine.DEEPSPEED.value: ("DeepSpeed", "ZeRO-2, DeepSpeed's AdamW, no offload"),
    Engine.FSDP2.value: ("FSDP2", "fully_shard per layer + root, no reshard after forward, torch AdamW, no offload"),
}
"""The choices of --engine: the name in the rows, the settings in the heading."""
FSDP2 = Fsdp2EngineSection(reshard_after_forward=False, cpu_offload=False, reduce_dtype=Precision.FP32)
"""The fsdp2 side's settings (as memfit.render.fsdp2 renders ZeRO-2 without offload)."""

TRAINER_EXTRAS = (
    "takes its micro-batch from the packed, sharded data pipeline (bare: a prepared list of random tokens)",
    "accumulates the loss and all-reduces it across ranks (one extra collective per step, a sync point)",
    "reads the learning rate and records the step: Prometheus histogram, counters and gauges on every rank",
    "rank 0: rewrites the progress file (temp file + rename) and prints the console line (at most every 5 s)",
    "checks the checkpoint schedule and keeps the OOM guard's step (checkpoint saves themselves excluded)",
)


def deepspeed_config(precision: PlannedPrecision) -> dict[str, Any]:
    """The one DeepSpeed config both sides use: ZeRO-2, DeepSpeed's AdamW, no offload."""
    return {
        "train_batch_size": MICRO_BATCH * WORLD_SIZE,
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 2**31 - 1,
        "bf16": {"enabled": precision == Precision.BF16},
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": LEARNING_RATE, "weight_decay": 0.0}},
    }


def write_corpus(path: Path, tokens: int) -> Path:
    """Varied English-like jsonl text of at least ``tokens`` bytes (the byte tokenizer: one token a byte)."""
    words = ["the", "a", "cat", "dog", "tree", "house", "boat", "sky", "red", "green", "old", "small", "sees"]
    written, i = 0, 0
    with path.open("w") as f:
        while written < tokens:
            text = " ".join(words[(i * 7 + k * k) % len(words)] for k in range(40)) + "."
            f.write(json.dumps({"text": text}) + "\n")
            written, i = written + len(text) + 1, i + 1
    return path


def trainer_config(workdir: Path, steps: int, precision: PlannedPrecision, engine: Engine) -> TrainerConfig:
    """A TrainerConfig equivalent to the engine's bare loop; its only checkpoint is the final one, after the last
    step."""
    blocks = 2 * steps * MICRO_BATCH * WORLD_SIZE  # twice what the run reads: no epoch rollover mid-run
    return TrainerConfig(
        job="bench/trainer-vs-deepspeed",
        model=ModelConfig(name_or_path="bench-llama", random_init=True, architecture=ARCHITECTURE),
        data=DataConfig(path=str(write_corpus(workdir / "corpus.jsonl", blocks * SEQUENCE_LENGTH)), text_field="text"),
        training=TrainingConfig(
            method=Method.FULL,
            sequence_length=SEQUENCE_LENGTH,
            micro_batch_size=MICRO_BATCH,
            gradient_accumulation_steps=1,
            global_batch_size=MICRO_BATCH * WORLD_SIZE,
            max_steps=steps,
            learning_rate=LEARNING_RATE,
            warmup_ratio=0.1,
            precision=precision,
            attention=Attention.SDPA,
            checkpoint_every_steps=steps + 1,
            keep_checkpoints=1,
        ),
        output_dir=str(workdir / "output"),
        engine=FSDP2 if engine == Engine.FSDP2 else DeepSpeedEngineSection(config=deepspeed_config(precision)),
        metrics=MetricsConfig(port=0, progress_file=str(workdir / "progress.json")),
        termination_log=str(workdir / "termination-log"),
    )


# ---------------------------------------------------------------- workers (one per rank, under torchrun)


def _write_json(path: Path, document: dict[str, Any]) -> None:
    path.write_text(json.dumps(document, indent=2) + "\n")


def _deepspeed_step(config: TrainerConfig, model: Any) -> Callable[[torch.Tensor], None]:
    """One optimizer step of the bare DeepSpeed loop."""
    import deepspeed
    from torch.optim.lr_scheduler import LambdaLR

    assert isinstance(config.engine, DeepSpeedEngineSection)
    params = [p for p in model.parameters() if p.requires_grad]
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=params,
        lr_scheduler=lambda optimizer: LambdaLR(optimizer, lambda step: 1.0),
        config=config.engine.config,
    )

    def step(tokens: torch.Tensor) -> None:
        input_ids = tokens.to(engine.device)
        outputs = engine(input_ids=input_ids, labels=input_ids)
        engine.backward(outputs.loss)
        engine.step()

    return step


def _fsdp2_step(config: TrainerConfig, model: Any) -> Callable[[torch.Tensor], None]:
    """One optimizer step of the bare FSDP2 loop."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.optim.lr_scheduler import LambdaLR

    training = config.training
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    bf16 = training.precision == Precision.BF16  # fp32 masters, bf16 compute; else all fp32
    options: dict[str, Any] = {
        "mesh": init_device_mesh(device.type, (dist.get_world_size(),)),
        "reshard_after_forward": FSDP2.reshard_after_forward,
        "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32),
    }
    for layer in model.model.layers:
        fully_shard(layer.float(), **options)
    fully_shard(model.float(), **options)
    optimizer = torch.optim.AdamW(model.parameters(), lr=training.learning_rate, weight_decay=0.0)
    scheduler = LambdaLR(optimizer, lambda step: 1.0)

    def step(tokens: torch.Tensor) -> None:
        input_ids = tokens.to(device)
        model(input_ids=input_ids, labels=input_ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), training.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()

    return step


def bare_worker(config_path: Path, out: Path) -> int:
    """One rank of the bare loop of the config's engine; rank 0 writes its step seconds to ``out``."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from memfit_trainer.hf_config import transformers_config
    from memfit_trainer.model import DTYPES

    config = TrainerConfig.model_validate(json.loads(config_path.read_text()))
    training, architecture = config.training, config.model.architecture
    assert architecture is not None and training.max_steps is not None
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if config.engine.kind == Engine.FSDP2:
        dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    else:
        import deepspeed

        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank()
    torch.manual_seed(training.seed)  # the trainer's random init: the same weights
    model = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]  # unannotated in transformers
        transformers_config(architecture),
        dtype=DTYPES[training.precision],
        attn_implementation=ATTN_IMPLEMENTATION[training.attention],
    )
    model.config.use_cache = False
    step = (_fsdp2_step if config.engine.kind == Engine.FSDP2 else _deepspeed_step)(config, model)
    generator = torch.Generator().manual_seed(training.seed + rank)
    size = (training.micro_batch_size, training.sequence_length)
    batches = [torch.randint(0, architecture.vocab_size, size, generator=generator) for _ in range(training.max_steps)]
    seconds: list[float] = []
    for tokens in batches:
        started = time.monotonic()
        step(tokens)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        seconds.append(time.monotonic() - started)
    if rank == 0:
        _write_json(out, {"step_seconds": seconds})
    dist.barrier()
    dist.destroy_process_group()
    return 0


def trainer_worker(config_path: Path, out: Path) -> int:
    """One rank of ``memfit-train`` (its ``main``, unchanged) with a recorder on its step metrics."""
    from memfit_trainer import main as trainer_main
    from memfit_trainer.metrics import TrainerMetrics

    step_seconds: list[float] = []
    called_at: list[float] = []
    histogram: dict[str, float | None] = {}
    record_step, close = TrainerMetrics.step, TrainerMetrics.close

    def recording_step(self: TrainerMetrics, **kwargs: Any) -> None:
        called_at.append(time.monotonic())
        step_seconds.append(kwargs["step_seconds"])
        record_step(self, **kwargs)

    def reading_close(self: TrainerMetrics) -> None:
        labels = {"finetunejob": self._labels[0], "rank": self._labels[1]}
        for suffix in ("sum", "count"):
            name = f"memfit_train_step_duration_seconds_{suffix}"
            histogram[suffix] = self.registry.get_sample_value(name, labels)
        histogram["rank"] = self.rank
        close(self)

    TrainerMetrics.step = recording_step  # type: ignore[method-assign]
    TrainerMetrics.close = reading_close  # type: ignore[method-assign]
    code = trainer_main.main(["--config", str(config_path)])
    if histogram.get("rank") == 0:
        intervals = [b - a for a, b in zip(called_at, called_at[1:], strict=False)]
        _write_json(out, {"step_seconds": step_seconds, "intervals": intervals, "histogram": histogram})
    return code


# ---------------------------------------------------------------- the driver


def _run_ranks(role: str, config_path: Path, out: Path, log: Path) -> float:
    """``torchrun`` this file as ``role`` on WORLD_SIZE local ranks; its wall seconds (log kept in ``log``)."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD_SIZE}",
        str(Path(__file__).resolve()), "--worker", role, "--config", str(config_path), "--out", str(out),
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR")}
    env.update(OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    started = time.monotonic()
    with log.open("w") as handle:
        result = subprocess.run(command, env=env, stdout=handle, stderr=subprocess.STDOUT, check=False)
    if result.returncode != 0 or not out.exists():
        tail = "".join(log.read_text().splitlines(keepends=True)[-30:])
        raise SystemExit(f"{role} run failed (exit {result.returncode}); last lines of {log}:\n{tail}")
    return time.monotonic() - started


def _p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10, method="inclusive")[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="timed optimizer steps per side (after warm-up)")
    parser.add_argument("--warmup", type=int, default=5, help="first steps of each side left out of the figures")
    parser.add_argument("--rounds", type=int, default=1, help="runs per side, alternating the order")
    parser.add_argument(
        "--precision",
        choices=tuple(PRECISIONS),
        default=Precision.FP32.value,
        help="both sides' precision",
    )
    parser.add_argument("--engine", choices=(*ENGINES, "both"), default="both", help="the engine(s) to compare on")
    parser.add_argument("--keep", type=Path, help="keep configs, logs and raw timings in a new directory in this one")
    parser.add_argument("--worker", choices=("bare", "trainer"), help=argparse.SUPPRESS)
    parser.add_argument("--config", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker = bare_worker if args.worker == "bare" else trainer_worker
        sys.exit(worker(args.config, args.out))

    if args.warmup < 1 or args.steps < 2 or args.rounds < 1:
        parser.error(
            "needs --warmup >= 1 (the first step-to-step interval ends at step 2), --steps >= 2, --rounds >= 1"
        )
    total = args.warmup + args.steps
    precision = PRECISIONS[args.precision]
    engines = [Engine(name) for name in ENGINES] if args.engine == "both" else [Engine(args.engine)]
    print(
        f"llama hidden {ARCHITECTURE.hidden_size} x {ARCHITECTURE.num_layers} layers, vocab {ARCHITECTURE.vocab_size}, "
        f"{args.precision}; {WORLD_SIZE} ranks x {MICRO_BATCH} x {SEQUENCE_LENGTH} tokens; {args.rounds} x {total} "
        f"steps a side, first {args.warmup} of each run dropped",
        flush=True,
    )
    for engine in engines:
        print(f"  {ENGINES[engine][0]}: {ENGINES[engine][1]}", flush=True)
    # runs[engine][role]: each run's timings; walls likewise its torchrun wall seconds
    runs: dict[Engine, dict[str, list[dict[str, Any]]]] = {e: {"bare": [], "trainer": []} for e in engines}
    walls: dict[Engine, dict[str, list[float]]] = {e: {"bare": [], "trainer": []} for e in engines}
    with tempfile.TemporaryDirectory(prefix="memfit-bench-") as scratch:
        if args.keep:  # a fresh directory each time: a checkpoint left there would make the trainer resume
            args.keep.mkdir(parents=True, exist_ok=True)
        workdir = Path(tempfile.mkdtemp(prefix="run-", dir=args.keep)) if args.keep else Path(scratch)
        for engine in engines:
            for round_ in range(args.rounds):
                for role in ("bare", "trainer") if round_ % 2 == 0 else ("trainer", "bare"):
                    print(f"running {engine} {role} ...", flush=True)
                    rundir = workdir / f"{engine}-{role}-{round_ + 1}"
                    rundir.mkdir()
                    config_path = rundir / "trainer-config.json"
                    config_path.write_text(trainer_config(rundir, total, precision, engine).to_json())
                    out = rundir / "timings.json"
                    walls[engine][role].append(_run_ranks(role, config_path, out, rundir / "log.txt"))
                    runs[engine][role].append(json.loads(out.read_text()))

    agree = True
    for trainer in (run for engine in engines for run in runs[engine]["trainer"]):
        hist, recorded = trainer["histogram"], trainer["step_seconds"]
        agree &= hist["count"] == len(recorded) and abs(hist["sum"] - sum(recorded)) <= 1e-6 * max(1, sum(recorded))
    print(f"\n{'rank 0, seconds per step':<40} {'steps':>5} {'median':>8} {'p90':>8} {'ratio':>7} {'p90 ratio':>10}")
    for engine in engines:
        name, bare, trainer_runs = ENGINES[engine][0], runs[engine]["bare"], runs[engine]["trainer"]
        # intervals[i] ends at step i + 2's record: drop the same warm-up steps as the others.
        rows = {
            f"{name}: bare loop": [s for run in bare for s in run["step_seconds"][args.warmup :]],
            f"{name}: memfit-train, histogram step": [
                s for r in trainer_runs for s in r["step_seconds"][args.warmup :]
            ],
            f"{name}: memfit-train, step-to-step": [s for r in trainer_runs for s in r["intervals"][args.warmup - 1 :]],
        }
        base = rows[f"{name}: bare loop"]
        base_median, base_p90 = statistics.median(base), _p90(base)
        for title, values in rows.items():
            median, p90 = statistics.median(values), _p90(values)
            print(f"{title:<40} {len(values):>5} {median:>8.4f} {p90:>8.4f} "
                  f"{median / base_median:>7.3f} {p90 / base_p90:>10.3f}")  # fmt: skip
    print("(ratio: over the same engine's bare loop)\n")
    for engine in engines:
        for role in ("bare", "trainer"):
            medians = ", ".join(
                f"{statistics.median(run['step_seconds'][args.warmup :]):.4f}" for run in runs[engine][role]
            )
            seconds = ", ".join(f"{wall:.1f}" for wall in walls[engine][role])
            label = f"{ENGINES[engine][0]} {role}"
            print(f"{label:<18} per run: median step {medians} s; torchrun wall time {seconds} s")
    print("(wall time: start-up, every step, shutdown; for the trainer also its final save)")
    verdict = "match" if agree else "DO NOT MATCH"
    print(f"memfit_train_step_duration_seconds _count and _sum {verdict} the recorded trainer steps")
    print("\nper step, memfit-train also:")
    for line in TRAINER_EXTRAS:
        print(f"  - {line}")
    print("  (histogram step: data fetch to loss all-reduce; step-to-step adds the bookkeeping after it)")


if __name__ == "__main__":
    main()
