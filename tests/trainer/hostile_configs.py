"""A corpus of invalid trainer configs, each made from a valid rendered one by one hostile change.

``valid_document`` renders the tiny example the way ``memfit run --local`` does (one rank, so that the
trainer's preflight accepts it in a single process); :data:`HOSTILE` derives from it configs with wrong
types, strings for numbers, out-of-range, infinite and NaN numbers, unknown keys, missing sections,
inconsistent batch sizes, paths that are relative, climb or leave their volume, a DeepSpeed section that
contradicts the training section, and files that are not a config at all (not UTF-8, not an object, nested
without end, too large).

Every one must make ``memfit-train --config FILE`` exit 2 with one ``memfit-train: ...`` line naming the
problem (``expect``) and a ConfigError termination message, before any work: never a traceback, never a
run.
"""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from memfit.cli.main import main as memfit_main

ROOT = Path(__file__).parent.parent.parent
TINY = ROOT / "examples" / "tiny"

Document = dict[str, Any]
Maker = Callable[[Document, Path], bytes]
"""The file's bytes, from a copy of the valid document and a directory of the case's own."""


def valid_document(directory: Path) -> Document:
    """``memfit run examples/tiny/job.yaml --local --nproc 1 --dry-run`` in ``directory`` (on the DeepSpeed
    engine): the config."""
    shutil.copytree(TINY / "data", directory / "data")
    job = yaml.safe_load((TINY / "job.yaml").read_text())
    job["spec"].setdefault("strategy", {})["engine"] = "deepspeed"  # the cases edit its DeepSpeed section
    (directory / "job.yaml").write_text(yaml.safe_dump(job))
    work = directory / "work"
    code = memfit_main(["run", str(directory / "job.yaml"), "--local", "--nproc", "1", "--dry-run",
                        "--workdir", str(work)])  # fmt: skip
    assert code == 0
    document: Document = json.loads((work / "trainer-config.json").read_text())
    return document


def encode(document: Any) -> bytes:
    return json.dumps(document, indent=2).encode()


def _walk(document: Document, path: str) -> tuple[Any, str]:
    *parents, key = path.split(".")
    node: Any = document
    for part in parents:
        node = node[part]
    return node, key


def setting(path: str, value: Any) -> Maker:
    """``path`` (dotted) set to ``value``."""

    def make(document: Document, _: Path) -> bytes:
        node, key = _walk(document, path)
        node[key] = value
        return encode(document)

    return make


def settings(**values: Any) -> Maker:
    """Several dotted paths (``__`` for the dots) set at once."""

    def make(document: Document, directory: Path) -> bytes:
        for path, value in values.items():
            node, key = _walk(document, path.replace("__", "."))
            if value is DROP:
                node.pop(key, None)
            else:
                node[key] = value
        return encode(document)

    return make


DROP = object()


def dropping(path: str) -> Maker:
    return settings(**{path.replace(".", "__"): DROP})


def doubled(path: str) -> Maker:
    """``path`` (an integer) set to twice its value."""

    def make(document: Document, _: Path) -> bytes:
        node, key = _walk(document, path)
        node[key] *= 2
        return encode(document)

    return make


def raw_number(path: str, literal: str) -> Maker:
    """``path`` set to a number literal Python's json would write differently (NaN, 1e999, long digits)."""

    def make(document: Document, _: Path) -> bytes:
        node, key = _walk(document, path)
        node[key] = "@@RAW@@"
        return encode(document).replace(b'"@@RAW@@"', literal.encode())

    return make


def constant(content: bytes) -> Maker:
    return lambda _document, _directory: content


def fsdp2(**values: Any) -> Maker:
    """The fsdp2 engine with the given settings, and the other dotted paths (``__`` for the dots) set."""
    engine = {"kind": "fsdp2", **{key: value for key, value in values.items() if "__" not in key}}
    return settings(engine=engine, **{key: value for key, value in values.items() if "__" in key})


def deepspeed_zero(**zero: Any) -> Maker:
    def make(document: Document, _: Path) -> bytes:
        document["engine"]["config"]["zero_optimization"].update(zero)
        return encode(document)

    return make


def symlinked_output(document: Document, directory: Path) -> bytes:
    """outputDir inside its volume by name, but a symlink in the volume leads out of it."""
    volume, elsewhere = directory / "output-volume", directory / "elsewhere"
    volume.mkdir()
    elsewhere.mkdir()
    (volume / "tiny").symlink_to(elsewhere)
    document["volumes"]["output"] = str(volume)
    document["outputDir"] = str(volume / "tiny")
    return encode(document)


def symlinked_data(document: Document, directory: Path) -> bytes:
    """data.path a symlink in the data volume to a file outside it."""
    volume = directory / "data-volume"
    volume.mkdir()
    secret = directory / "secret.jsonl"
    secret.write_text('{"text": "not for training"}\n')
    (volume / "train.jsonl").symlink_to(secret)
    document["volumes"]["data"] = str(volume)
    document["data"]["path"] = str(volume / "train.jsonl")
    return encode(document)


def nested_inside(document: Document, _: Path) -> bytes:
    value: Any = 1
    for _level in range(40):
        value = {"x": value}
    document["engine"]["config"]["zero_optimization"]["deep"] = value
    return encode(document)


def duplicate_key(document: Document, _: Path) -> bytes:
    text = encode(document).decode()
    return text.replace('"job":', '"job": "other/job",\n  "job":', 1).encode()


def qlora_zero3(document: Document, _: Path) -> bytes:
    document["training"]["method"] = "qlora"
    document["engine"]["config"]["zero_optimization"] = {"stage": 3}
    return encode(document)


def eight_bit_offloaded(document: Document, _: Path) -> bytes:
    document["training"]["optimizer"] = "adamw8bit"
    document["engine"]["config"].pop("optimizer")
    document["engine"]["config"]["zero_optimization"].update(stage=2, offload_optimizer={"device": "cpu"})
    return encode(document)


def both_precisions(document: Document, _: Path) -> bytes:
    document["engine"]["config"]["fp16"] = {"enabled": True}
    return encode(document)


def other_precision(document: Document, _: Path) -> bytes:
    document["engine"]["config"].pop("bf16")
    document["engine"]["config"]["fp16"] = {"enabled": True, "loss_scale": 0}
    return encode(document)


def client_and_deepspeed_optimizer(document: Document, _: Path) -> bytes:
    document["training"]["optimizer"] = "adafactor"
    return encode(document)


def both_lengths(document: Document, _: Path) -> bytes:
    document["training"]["epochs"] = 2
    return encode(document)


def no_length(document: Document, _: Path) -> bytes:
    document["training"].pop("maxSteps")
    return encode(document)


def epochs_zero(document: Document, _: Path) -> bytes:
    document["training"].pop("maxSteps")
    document["training"]["epochs"] = 0
    return encode(document)


def missing_data(document: Document, directory: Path) -> bytes:
    document["data"]["path"] = str(Path(document["volumes"]["data"]) / "absent.jsonl")
    return encode(document)


def random_init_without_architecture(document: Document, _: Path) -> bytes:
    document["model"].pop("architecture")
    return encode(document)


def heads_without_head_dim(heads: int) -> Maker:
    def make(document: Document, _: Path) -> bytes:
        document["model"]["architecture"].pop("headDim")
        document["model"]["architecture"]["numAttentionHeads"] = heads
        return encode(document)

    return make


@dataclass(frozen=True)
class Hostile:
    name: str
    make: Maker
    expect: str
    """A fragment the one error line must contain: the config is refused for this reason."""


HOSTILE: tuple[Hostile, ...] = (
    # --- wrong types, strings for numbers
    Hostile("string-for-integer", setting("training.microBatchSize", "4"), "training.microBatchSize"),
    Hostile("float-for-integer", setting("training.microBatchSize", 4.0), "training.microBatchSize"),
    Hostile("bool-for-integer", setting("training.microBatchSize", True), "training.microBatchSize"),
    Hostile("string-for-number", setting("training.learningRate", "0.001"), "training.learningRate"),
    Hostile("string-for-bool", setting("training.gradientCheckpointing", "false"), "training.gradientCheckpointing"),
    Hostile("integer-for-bool", setting("model.randomInit", 1), "model.randomInit"),
    Hostile("string-version", setting("version", "1"), "version"),
    Hostile("bool-version", setting("version", True), "version"),
    Hostile("future-version", setting("version", 2), "version"),
    Hostile("number-for-string", setting("job", 42), "job"),
    Hostile("number-for-path", setting("data.path", 7), "data.path"),
    Hostile("unknown-on-bad-record", setting("data.onBadRecord", "ignore"), "data.onBadRecord"),
    Hostile("zero-max-record-mib", setting("data.maxRecordMib", 0), "data.maxRecordMib"),
    Hostile("string-for-changed", setting("data.changed", "yes"), "data.changed"),
    Hostile("string-for-section", setting("engine.config", "zero2"), "deepspeed"),
    Hostile("list-for-section", setting("engine.config", []), "deepspeed"),
    Hostile("null-section", setting("training", None), "training"),
    Hostile("string-architecture-size", setting("model.architecture.numLayers", "4"), "architecture.numLayers"),
    Hostile("string-for-list", setting("training.lora.targetModules", "all-linear"), "targetModules"),
    Hostile("string-port", setting("metrics.port", "9400"), "metrics.port"),
    Hostile("unknown-precision", setting("training.precision", "fp8"), "training.precision"),
    Hostile("flex-on-cpu", setting("training.attention", "flex"), "flex_attention has no backward pass on the CPU"),
    Hostile("planned-method-auto", setting("training.method", "auto"), "training.method"),
    # --- numbers out of range: zero, negative, huge, infinite, NaN
    Hostile("zero-micro-batch", setting("training.microBatchSize", 0), "training.microBatchSize"),
    Hostile("negative-micro-batch", setting("training.microBatchSize", -4), "training.microBatchSize"),
    Hostile("huge-sequence-length", setting("training.sequenceLength", 10**12), "training.sequenceLength"),
    Hostile("huge-max-steps", setting("training.maxSteps", 10**30), "training.maxSteps"),
    Hostile("integer-of-5000-digits", raw_number("training.maxSteps", "9" * 5000), "not valid JSON"),
    Hostile("zero-learning-rate", setting("training.learningRate", 0), "training.learningRate"),
    Hostile("negative-learning-rate", setting("training.learningRate", -1e-3), "training.learningRate"),
    Hostile("huge-learning-rate", setting("training.learningRate", 1e300), "training.learningRate"),
    Hostile("infinite-learning-rate", raw_number("training.learningRate", "1e999"), "out of range"),
    Hostile("nan-learning-rate", raw_number("training.learningRate", "NaN"), "NaN"),
    Hostile("infinity-warmup", raw_number("training.warmupRatio", "Infinity"), "Infinity"),
    Hostile("minus-infinity-clipping", raw_number("engine.config.gradient_clipping", "-Infinity"), "Infinity"),
    Hostile("whole-warmup", setting("training.warmupRatio", 1.0), "training.warmupRatio"),
    Hostile("zero-grad-norm", setting("training.maxGradNorm", 0), "training.maxGradNorm"),
    Hostile("negative-seed", setting("training.seed", -1), "training.seed"),
    Hostile("huge-seed", setting("training.seed", 2**64), "training.seed"),
    Hostile("no-checkpoints-kept", setting("training.keepCheckpoints", 0), "training.keepCheckpoints"),
    Hostile("zero-checkpoint-interval", setting("training.checkpointEverySteps", 0), "checkpointEverySteps"),
    Hostile("dropout-above-one", setting("training.lora.dropout", 1.5), "training.lora.dropout"),
    Hostile("zero-lora-rank", setting("training.lora.rank", 0), "training.lora.rank"),
    Hostile("zero-heads", heads_without_head_dim(0), "model.architecture"),
    Hostile("heads-not-dividing-width", heads_without_head_dim(3), "model.architecture"),
    Hostile("negative-width", setting("model.architecture.hiddenSize", -128), "model.architecture"),
    Hostile("huge-vocabulary", setting("model.architecture.vocabSize", 10**12), "model.architecture"),
    Hostile("kv-heads-not-dividing", setting("model.architecture.numKeyValueHeads", 3), "numKeyValueHeads"),
    Hostile("port-out-of-range", setting("metrics.port", 70000), "metrics.port"),
    Hostile("negative-prediction", setting("prediction.peakAllocatedBytes", -1), "prediction.peakAllocatedBytes"),
    Hostile("negative-throughput", setting("prediction.tokensPerSecond", -5.0), "prediction.tokensPerSecond"),
    Hostile("zero-epochs", epochs_zero, "training.epochs"),
    # --- unknown keys, missing sections
    Hostile("unknown-top-level-key", setting("extra", 1), "extra"),
    Hostile("misspelt-training-key", setting("training.microbatchSize", 4), "microbatchSize"),
    Hostile("misspelt-deepspeed-key", setting("engine.config.zero_optimisation", {"stage": 2}), "zero_optimisation"),
    Hostile("unknown-zero-key", deepspeed_zero(stage3_typo=1), "stage3_typo"),
    Hostile("missing-model", dropping("model"), "model"),
    Hostile("missing-training", dropping("training"), "training"),
    Hostile("missing-deepspeed", dropping("engine.config"), "deepspeed"),
    Hostile("missing-output-dir", dropping("outputDir"), "outputDir"),
    Hostile("missing-data-path", dropping("data.path"), "data.path"),
    Hostile("neither-epochs-nor-steps", no_length, "epochs"),
    Hostile("both-epochs-and-steps", both_lengths, "epochs"),
    Hostile("random-init-without-architecture", random_init_without_architecture, "architecture"),
    # --- inconsistent batch sizes
    Hostile("global-batch-not-a-multiple", setting("training.globalBatchSize", 6), "globalBatchSize"),
    Hostile(
        "deepspeed-micro-batch-differs",
        doubled("engine.config.train_micro_batch_size_per_gpu"),
        "train_micro_batch_size_per_gpu",
    ),  # fmt: skip
    Hostile(
        "deepspeed-accumulation-differs",
        doubled("engine.config.gradient_accumulation_steps"),
        "gradient_accumulation_steps",
    ),  # fmt: skip
    Hostile("deepspeed-global-batch-differs", doubled("engine.config.train_batch_size"), "train_batch_size"),
    Hostile(
        "deepspeed-micro-batch-as-float",
        setting("engine.config.train_micro_batch_size_per_gpu", 8.0),
        "train_micro_batch_size_per_gpu",
    ),  # fmt: skip
    Hostile(
        "deepspeed-micro-batch-as-bool",
        setting("engine.config.gradient_accumulation_steps", True),
        "gradient_accumulation_steps",
    ),  # fmt: skip
    # --- a DeepSpeed section contradicting the training section
    Hostile("zero-stage-4", deepspeed_zero(stage=4), "stage"),
    Hostile("zero-stage-negative", deepspeed_zero(stage=-1), "stage"),
    Hostile("zero-stage-string", deepspeed_zero(stage="2"), "stage"),
    Hostile("zero-section-a-list", setting("engine.config.zero_optimization", [2]), "zero_optimization"),
    Hostile(
        "optimizer-offload-without-zero",
        deepspeed_zero(stage=0, offload_optimizer={"device": "cpu"}),
        "offload_optimizer needs ZeRO",
    ),  # fmt: skip
    Hostile(
        "parameter-offload-below-zero3",
        deepspeed_zero(offload_param={"device": "cpu"}),
        "offload_param needs ZeRO stage 3",
    ),  # fmt: skip
    Hostile("offload-to-gpu", deepspeed_zero(stage=2, offload_optimizer={"device": "gpu"}), "device"),
    Hostile("nvme-without-path", deepspeed_zero(stage=3, offload_param={"device": "nvme"}), "nvme_path"),
    Hostile(
        "nvme-relative-path",
        deepspeed_zero(stage=3, offload_param={"device": "nvme", "nvme_path": "nvme"}),
        "nvme_path",
    ),  # fmt: skip
    Hostile("fp16-and-bf16", both_precisions, "both enabled"),
    Hostile("fp16-for-bf16-training", other_precision, "training.precision"),
    Hostile("bf16-for-fp32-training", setting("training.precision", "fp32"), "training.precision"),
    Hostile("precision-section-not-an-object", setting("engine.config.bf16", True), "bf16"),
    Hostile("precision-enabled-as-string", setting("engine.config.bf16", {"enabled": "true"}), "bf16.enabled"),
    Hostile("unknown-deepspeed-optimizer", setting("engine.config.optimizer.type", "SGD"), "SGD"),
    Hostile("deepspeed-learning-rate-differs", setting("engine.config.optimizer.params.lr", 0.5), "params.lr"),
    Hostile("deepspeed-optimizer-for-client-optimizer", client_and_deepspeed_optimizer, "deepspeed.optimizer"),
    Hostile("clipping-differs", setting("engine.config.gradient_clipping", 5.0), "gradient_clipping"),
    Hostile("betas-not-a-pair", setting("engine.config.optimizer.params.betas", [0.9]), "betas"),
    Hostile("qlora-under-zero3", qlora_zero3, "qlora"),
    Hostile("chunked-loss-as-string", setting("training.chunkedLoss", "true"), "chunkedLoss"),
    Hostile(
        "activation-offloading-without-checkpointing",
        settings(training__activationOffloading=True, training__gradientCheckpointing=False),
        "activationOffloading",
    ),
    Hostile("activation-offloading-as-string", setting("training.activationOffloading", "yes"), "activationOffloading"),
    Hostile(
        "qlora-in-fp16",
        settings(
            training__method="qlora",
            training__precision="fp16",
            engine__config__bf16=DROP,
            engine__config__fp16={"enabled": True},
        ),
        "qlora computes in bf16",
    ),
    Hostile("8bit-optimizer-offloaded", eight_bit_offloaded, "8-bit"),
    # --- paths
    Hostile("relative-data-path", setting("data.path", "data/train.jsonl"), "data.path"),
    Hostile("output-dir-climbing", setting("outputDir", "/mnt/output/../../tmp/x"), "outputDir"),
    Hostile("empty-output-dir", setting("outputDir", ""), "outputDir"),
    Hostile("nul-in-output-dir", setting("outputDir", "/tmp/out\x00put"), "outputDir"),
    Hostile("nul-in-termination-log", setting("terminationLog", "/tmp/termination\x00log"), "terminationLog"),
    Hostile("newline-in-progress-file", setting("metrics.progressFile", "/tmp/progress\n.json"), "progressFile"),
    Hostile("output-outside-its-volume", setting("outputDir", "/tmp/elsewhere"), "outside the output volume"),
    Hostile("data-outside-its-volume", setting("data.path", "/etc/passwd"), "outside the data volume"),
    Hostile("relative-volume", setting("volumes.output", "output"), "volumes.output"),
    Hostile("output-symlink-out-of-its-volume", symlinked_output, "outside its volume"),
    Hostile("data-symlink-out-of-its-volume", symlinked_data, "outside its volume"),
    Hostile("data-missing", missing_data, "does not exist"),
    Hostile("model-path-climbing", setting("model.nameOrPath", "../models/llama"), "model.nameOrPath"),
    Hostile("token-env-not-a-name", setting("model.tokenEnv", "HF TOKEN"), "model.tokenEnv"),
    Hostile("all-linear-and-more", setting("training.lora.targetModules", ["all-linear", "q_proj"]), "all-linear"),
    Hostile("job-without-namespace", setting("job", "tiny"), "job"),
    # --- the engine section: DeepSpeed or fsdp2, by its kind
    Hostile("fsdp2-with-a-deepspeed-section", setting("engine.kind", "fsdp2"), "engine.fsdp2.config"),
    Hostile("engine-without-its-kind", dropping("engine.kind"), "kind"),
    Hostile("engine-as-a-name", setting("engine", "deepspeed"), "engine"),
    Hostile(
        "fsdp2-settings-on-deepspeed", setting("engine.reshardAfterForward", True), "deepspeed.reshardAfterForward"
    ),
    Hostile("unknown-engine", setting("engine", {"kind": "fsdp"}), "engine"),
    Hostile("fsdp2-reshard-as-a-string", fsdp2(reshardAfterForward="true"), "reshardAfterForward"),
    Hostile("fsdp2-unknown-key", fsdp2(shardDegree=2), "shardDegree"),
    Hostile("fsdp2-fp16-reduce", fsdp2(reduceDtype="fp16"), "reduceDtype"),
    Hostile("fsdp2-adafactor-optimizer", fsdp2(training__optimizer="adafactor"), "deepspeed engine"),
    Hostile("fsdp2-fp16", fsdp2(training__precision="fp16"), "loss scaling"),
    Hostile("fsdp2-lion", fsdp2(training__optimizer="lion"), "lion"),
    # --- files that are not a config
    Hostile("not-utf8", constant(b'{"version": 1, "job": "default/t\xff\xfeny"}'), "not UTF-8"),
    Hostile("utf8-bom", lambda d, _: b"\xef\xbb\xbf" + encode(d), "not valid JSON"),
    Hostile("json-array", constant(b"[1, 2, 3]"), "expected a JSON object"),
    Hostile("json-string", constant(b'"trainer-config"'), "expected a JSON object"),
    Hostile("json-null", constant(b"null"), "expected a JSON object"),
    Hostile("empty-file", constant(b""), "not valid JSON"),
    Hostile("truncated", lambda d, _: encode(d)[:200], "not valid JSON"),
    Hostile("nested-without-end", constant(b"[" * 100_000 + b"]" * 100_000), "nested"),
    Hostile("nested-inside-an-object", nested_inside, "nested deeper"),
    Hostile("huge-file", lambda d, _: encode(d)[:-1] + b" " * (2 * 1024 * 1024) + b"}", "larger than"),
    Hostile("duplicate-key", duplicate_key, "appears twice"),
)


def materialise(case: Hostile, valid: Document, directory: Path) -> Path:
    """The case's config file in ``directory`` (the valid document's termination log moved there too)."""
    document = copy.deepcopy(valid)
    document["terminationLog"] = str(directory / "termination-log")
    path = directory / "config.json"
    path.write_bytes(case.make(document, directory))
    return path
