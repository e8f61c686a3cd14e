"""A corpus of malformed and hostile inputs for `memfit plan`, and a few valid edge cases.

Each case is one file holding a FineTuneJob and the GPUPools of examples/inventory.yaml, derived from
examples/llama-3.1-8b-lora.yaml (or examples/custom-architecture.yaml, for the architecture's sizes) and
mutated: wrong types, values out of range, missing and unknown fields, duplicate keys, YAML aliases and deep
nesting, huge integers, infinities, other encodings, binary, empty files, names with markup and escape codes.
Deterministic: the same files every time (random bytes come from a seeded generator).

    python tests/hostile/generate.py DIR    # writes DIR/<case>.yaml and DIR/index.json

tests/hostile/test_corpus.py runs `memfit plan` over every case: a bad one must exit 2 with one line naming
the file, the object and the field (or the line, for what is not valid YAML); a valid one must plan.
"""

from __future__ import annotations

import codecs
import copy
import json
import random
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).parent.parent.parent
EXAMPLES = ROOT / "examples"
JOB: dict[str, Any] = yaml.safe_load((EXAMPLES / "llama-3.1-8b-lora.yaml").read_text())
CUSTOM: dict[str, Any] = yaml.safe_load((EXAMPLES / "custom-architecture.yaml").read_text())
POOLS: list[dict[str, Any]] = list(yaml.safe_load_all((EXAMPLES / "inventory.yaml").read_text()))

JOB_OBJECT = ("(document 1)", "FineTuneJob 'llama-chat'")
CUSTOM_OBJECT = ("(document 1)", "FineTuneJob 'in-house-13b'")
POOL_OBJECT = ("(document 2)", "GPUPool 'a100-80gb'")
NOT_YAML = ("not valid YAML: line ",)


@dataclass(frozen=True)
class Case:
    name: str
    """File name without `.yaml`: lower-case letters, digits and dashes."""
    content: bytes
    expect: tuple[str, ...] = ()
    """Texts the error line must hold besides the file name (the object, the field, the line)."""
    valid: bool = False
    """A valid edge case: it must plan (exit 0, or 1 when nothing fits)."""


def dump(*documents: Any) -> bytes:
    return yaml.safe_dump_all(documents, sort_keys=False, allow_unicode=True).encode()


def with_pools(job: Any, pools: list[dict[str, Any]] | None = None) -> bytes:
    return dump(job, *(POOLS if pools is None else pools))


def base_text() -> str:
    return with_pools(JOB).decode()


_MISSING = object()


def _set(document: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """A copy of ``document`` with ``path`` (dotted, list indices as numbers) set, or deleted for _MISSING."""
    document = copy.deepcopy(document)
    *parents, last = path.split(".")
    node: Any = document
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node.setdefault(part, {})
    if value is _MISSING:
        del node[last]
    elif isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return document


def job_case(name: str, path: str, value: Any, *expect: str, base: dict[str, Any] = JOB) -> Case:
    """The job with one field changed; the error must name the job and ``expect`` (default: the field)."""
    obj = CUSTOM_OBJECT if base is CUSTOM else JOB_OBJECT
    return Case(name, with_pools(_set(base, path, value)), (*obj, *(expect or (path,))))


def document_case(name: str, path: str, value: Any, *expect: str) -> Case:
    """The job with one field changed where the job has no name left to show: the document number does."""
    return Case(name, with_pools(_set(JOB, path, value)), ("(document 1)", *expect))


def pool_case(name: str, path: str, value: Any, *expect: str) -> Case:
    """The first pool with one field changed."""
    pools = [_set(POOLS[0], path, value), *POOLS[1:]]
    return Case(name, with_pools(JOB, pools), (*POOL_OBJECT, *(expect or (path,))))


def slug(text: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in text.lower()).strip("-")


# (field, smallest, largest, base document) of every integer the API takes.
INTEGERS: list[tuple[str, int, int, dict[str, Any]]] = [
    ("spec.training.globalBatchSize", 1, 65_536, JOB),
    ("spec.training.sequenceLength", 8, 4_194_304, JOB),
    ("spec.training.epochs", 1, 10_000_000, JOB),
    ("spec.training.maxSteps", 1, 10_000_000, JOB),
    ("spec.training.checkpointEverySteps", 1, 10_000_000, JOB),
    ("spec.training.seed", 0, 2**32 - 1, JOB),
    ("spec.lora.rank", 1, 4096, JOB),
    ("spec.resources.maxGPUs", 1, 640_000, JOB),
    ("spec.strategy.microBatchSize", 1, 65_536, JOB),
    ("spec.strategy.zeroStage", 0, 3, JOB),
    ("spec.strategy.sequenceParallel", 1, 64, JOB),
    ("spec.maxRestarts", 0, 100, JOB),
    ("spec.maxReplans", 0, 100, JOB),
    ("spec.dataset.maxRecordMib", 1, 1024, JOB),
    ("spec.model.architecture.hiddenSize", 1, 131_072, CUSTOM),
    ("spec.model.architecture.intermediateSize", 1, 1_048_576, CUSTOM),
    ("spec.model.architecture.numLayers", 1, 1024, CUSTOM),
    ("spec.model.architecture.numAttentionHeads", 1, 1024, CUSTOM),
    ("spec.model.architecture.numKeyValueHeads", 1, 1024, CUSTOM),
    ("spec.model.architecture.headDim", 1, 4096, CUSTOM),
    ("spec.model.architecture.vocabSize", 1, 4_194_304, CUSTOM),
    ("spec.model.architecture.numExperts", 1, 4096, CUSTOM),
    ("spec.model.architecture.expertsPerToken", 1, 4096, CUSTOM),
]
POOL_INTEGERS: list[tuple[str, int, int]] = [
    ("spec.gpusPerNode", 1, 64),
    ("spec.nodes", 1, 10_000),
    ("spec.tolerations.0.tolerationSeconds", 0, 315_360_000),
]
# (field, smallest, largest) of every number; None: no lower bound other than the type's.
FLOATS: list[tuple[str, float, float]] = [
    ("spec.training.learningRate", 0.0, 1.0),
    ("spec.training.warmupRatio", 0.0, 1.0),
    ("spec.training.weightDecay", 0.0, 10.0),
    ("spec.training.maxGradNorm", 0.0, 1e6),
    ("spec.lora.alpha", 0.0, 1e6),
    ("spec.lora.dropout", 0.0, 1.0),
    ("spec.resources.memoryHeadroomPercent", 0.0, 90.0),
]
POOL_FLOATS: list[tuple[str, float, float]] = [
    ("spec.gpuMemoryGiB", 1 / 16, 4096.0),
    ("spec.cpuMemoryGiBPerNode", 1 / 16, 65_536.0),
    ("spec.nvmeGiBPerNode", 0.0, 65_536.0),
    ("spec.nvmeGBpsPerNode", 0.01, 1e5),
    ("spec.interconnect.intraNodeGBps", 0.01, 1e5),
    ("spec.interconnect.interNodeGBps", 0.01, 1e5),
    ("spec.peakTFLOPS.bf16", 0.01, 1e6),
    ("spec.peakTFLOPS.fp16", 0.01, 1e6),
]
BOOLEANS: list[tuple[str, dict[str, Any]]] = [
    ("spec.suspend", JOB),
    ("spec.model.randomInit", JOB),
    ("spec.dataset.streaming", JOB),
    ("spec.dataset.changed", JOB),
    ("spec.strategy.gradientCheckpointing", JOB),
    ("spec.strategy.tiledMlp", JOB),
    ("spec.model.architecture.tieWordEmbeddings", CUSTOM),
]
ENUMS: list[tuple[str, dict[str, Any]]] = [
    ("spec.method", JOB),
    ("spec.dataset.format", JOB),
    ("spec.dataset.onBadRecord", JOB),
    ("spec.training.optimizer", JOB),
    ("spec.training.precision", JOB),
    ("spec.strategy.offloadOptimizer", JOB),
    ("spec.strategy.offloadParameters", JOB),
    ("spec.strategy.attention", JOB),
    ("spec.model.architecture.family", CUSTOM),
]


def typed_field_cases() -> Iterator[Case]:
    for path, low, high, base in INTEGERS:
        name = slug(path.removeprefix("spec."))
        values = [("string", str(high)), ("float", low + 0.5), ("bool", True), ("below", low - 1), ("above", high + 1)]
        if base is JOB:  # the architecture's sizes are integers like these: the same checks, fewer cases
            values += [("whole-float", float(high)), ("list", [low]), ("mapping", {"value": low}),
                       ("int64-max", 2**63 - 1)]  # fmt: skip
        for label, value in values:
            yield job_case(f"int-{name}-{label}", path, value, base=base)
    for path, low, high in POOL_INTEGERS:
        name = slug(path.removeprefix("spec."))
        for label, value in [("string", str(high)), ("float", low + 0.5), ("bool", True), ("below", low - 1),
                             ("above", high + 1), ("null", None)]:  # fmt: skip
            if label == "null" and "toleration" in path:
                continue  # optional: null is its default
            yield pool_case(f"pool-int-{name}-{label}", path, value)
    for path, low, high in FLOATS:
        name = slug(path.removeprefix("spec."))
        for label, value in [("inf", float("inf")), ("minus-inf", float("-inf")), ("nan", float("nan")),
                             ("string", str(high / 2)), ("bool", False), ("huge", 1e308), ("below", low - 1),
                             ("above", high * 10 + 1)]:  # fmt: skip
            yield job_case(f"float-{name}-{label}", path, value)
    for path, low, high in POOL_FLOATS:
        name = slug(path.removeprefix("spec."))
        for label, value in [("inf", float("inf")), ("nan", float("nan")), ("string", "80"), ("bool", True),
                             ("huge", 1e308), ("tiny", 1e-9 if low > 0 else -1e-9), ("above", high * 2)]:  # fmt: skip
            yield pool_case(f"pool-float-{name}-{label}", path, value)
    for path, base in BOOLEANS:
        name = slug(path.removeprefix("spec."))
        for label, value in [("yes-string", "yes"), ("true-string", "true"), ("one", 1), ("zero-float", 0.0)]:
            yield job_case(f"bool-{name}-{label}", path, value, base=base)
    for path, base in ENUMS:
        name = slug(path.removeprefix("spec."))
        for label, value in [("unknown", "bogus"), ("number", 7), ("list", ["x"]), ("upper", "LORA")]:
            yield job_case(f"enum-{name}-{label}", path, value, base=base)
    yield pool_case("pool-enum-toleration-operator", "spec.tolerations.0.operator", "Maybe")
    yield pool_case("pool-enum-toleration-effect", "spec.tolerations.0.effect", "NoWay")


def string_field_cases() -> Iterator[Case]:
    long = "a" * 300
    for path in ("spec.output.pvc", "spec.dataset.source.pvc", "spec.model.source.tokenSecretRef.name"):
        name = slug(path.removeprefix("spec."))
        base = JOB
        for label, value in [("upper", "Checkpoints"), ("underscore", "check_points"), ("long", long),
                             ("markup", "[/]"), ("escape", "x\x1b[31m"), ("empty", ""), ("number", 42),
                             ("dots", "a..b"), ("leading-dash", "-a")]:  # fmt: skip
            yield job_case(f"name-{name}-{label}", path, value, base=base)
    for path in ("spec.output.path", "spec.dataset.source.path"):
        name = slug(path.removeprefix("spec."))
        for label, value in [("parent", "../etc"), ("inner-parent", "a/../../b"), ("root-parent", "/.."),
                             ("only-parent", ".."), ("tab", "a\tb"), ("newline", "a\nb"), ("nul", "a\x00b"),
                             ("empty", ""), ("number", 7), ("too-long", "a/" * 3000)]:  # fmt: skip
            yield job_case(f"path-{name}-{label}", path, value)
    yield job_case("secret-key-bad", "spec.model.source.tokenSecretRef.key", "bad key!")
    yield job_case("hub-empty", "spec.model.source.hub", "")
    yield job_case("hub-number", "spec.model.source.hub", 12)
    yield job_case("model-name-empty", "spec.model.name", "")
    yield job_case("model-name-number", "spec.model.name", 3.5)
    yield job_case("lora-targets-empty", "spec.lora.targetModules", [])
    yield job_case("lora-targets-string", "spec.lora.targetModules", "all-linear")
    yield job_case("lora-targets-number", "spec.lora.targetModules", [1], "spec.lora.targetModules.0")
    yield job_case("lora-targets-markup", "spec.lora.targetModules", ["[bold]q_proj"], "spec.lora.targetModules.0")
    yield job_case("lora-targets-many", "spec.lora.targetModules", ["q_proj"] * 65)
    yield job_case("preset-empty", "spec.model.architecture.preset", "")
    yield job_case("text-field-empty", "spec.dataset.textField", "", "spec.dataset.textField")
    yield job_case("resources-pool-number", "spec.resources.pool", 5)
    yield job_case("labels-number-value", "metadata.labels", {"team": 1}, "metadata.labels.team")
    yield job_case("labels-list", "metadata.labels", ["team"], "metadata.labels")
    yield job_case("annotations-string", "metadata.annotations", "none", "metadata.annotations")
    yield job_case("namespace-number", "metadata.namespace", 7, "metadata.namespace")
    yield job_case("uid-number", "metadata.uid", 7, "metadata.uid")
    yield job_case("generation-string", "metadata.generation", "1", "metadata.generation")
    yield job_case("finalizers-string", "metadata.finalizers", "x", "metadata.finalizers")
    yield pool_case("pool-product-empty", "spec.gpuProduct", "")
    yield pool_case("pool-product-long", "spec.gpuProduct", "G" * 100)
    yield pool_case("pool-product-number", "spec.gpuProduct", 100)
    yield pool_case("pool-node-selector-number", "spec.nodeSelector", {"a": 1}, "spec.nodeSelector.a")
    yield pool_case("pool-tolerations-mapping", "spec.tolerations", {"key": "x"}, "spec.tolerations")
    yield pool_case("pool-toleration-value-long", "spec.tolerations.0.value", "v" * 64)


def shape_cases() -> Iterator[Case]:
    """Unknown and missing fields, wrong kinds of document."""
    for path in ("spec.typo", "spec.training.globalBatchSzie", "spec.model.architecture.typo", "spec.lora.Rank",
                 "spec.resources.maxGpus", "spec.output.claim", "metadata.labesl", "metadata.nmae",
                 "spec.training.global_batch_size", "spec.max_restarts", "spec.status", "extra"):  # fmt: skip
        yield job_case(f"unknown-{slug(path)}", path, 1, f"{path}: unknown field")
    for path in ("spec.typo", "spec.interconnect.typo", "spec.peakTFLOPS.fp32", "spec.gpus_per_node"):
        yield pool_case(f"pool-unknown-{slug(path)}", path, 1, f"{path}: unknown field")
    for path in ("spec", "spec.model", "spec.dataset", "spec.output", "spec.model.name",
                 "spec.output.pvc", "spec.dataset.source"):  # fmt: skip
        yield job_case(f"missing-{slug(path)}", path, _MISSING, f"{path}: required field is missing")
    for path in ("metadata", "metadata.name"):
        yield document_case(f"missing-{slug(path)}", path, _MISSING, f"FineTuneJob: {path}: required field is missing")
    for path in ("spec.gpusPerNode", "spec.nodes", "spec.cpuMemoryGiBPerNode", "spec.gpuProduct", "spec"):
        yield pool_case(f"pool-missing-{slug(path)}", path, _MISSING, f"{path}: required field is missing")
    yield document_case("missing-kind", "kind", _MISSING, "kind: required field is missing")
    yield document_case("missing-api-version", "apiVersion", _MISSING, "FineTuneJob: apiVersion must be")
    yield document_case("metadata-string", "metadata", "llama-chat", "FineTuneJob: metadata: ")
    yield document_case("metadata-list", "metadata", ["llama-chat"], "FineTuneJob: metadata: ")
    yield document_case("metadata-null", "metadata", None, "FineTuneJob: metadata: ")
    yield job_case("spec-string", "spec", "train it", "spec")
    yield job_case("spec-list", "spec", [1, 2], "spec")
    yield job_case("status-bad-phase", "status", {"phase": "Dancing"}, "status.phase")
    yield document_case("name-number", "metadata.name", 42, "FineTuneJob: metadata.name: ")
    yield document_case("name-empty", "metadata.name", "", "FineTuneJob: metadata.name: ")
    yield document_case("name-list", "metadata.name", ["a"], "FineTuneJob: metadata.name: ")
    for label, kind in [("list", ["FineTuneJob"]), ("number", 5), ("pod", "Pod"), ("mapping", {"a": 1}),
                        ("lower", "finetunejob"), ("markup", "[red]X[/]")]:  # fmt: skip
        yield document_case(f"kind-{label}", "kind", kind, "kind ", "is not one memfit reads")
    for label, version in [("v1", "v1"), ("number", 1), ("v2", "memfit.dev/v2"), ("list", ["memfit.dev/v1alpha1"])]:
        yield document_case(f"api-version-{label}", "apiVersion", version, "FineTuneJob: apiVersion must be")
    yield Case("document-list", dump([1, 2, 3]), ("(document 1)", "expected a mapping"))
    yield Case("document-scalar", dump("hello"), ("(document 1)", "expected a mapping"))
    yield Case("document-number", dump(42), ("(document 1)", "expected a mapping"))
    yield Case("pool-document-list", dump(JOB, [POOLS[0]]), ("(document 2)", "expected a mapping"))
    many = _set(JOB, "metadata.labels", {})
    for index in range(50):
        many["spec"][f"unknown{index}"] = index
    yield Case("unknown-fifty-fields", with_pools(many), (*JOB_OBJECT, "spec.unknown", "more problem"))
    huge_key = _set(JOB, "spec.training", {**JOB["spec"]["training"], "k" * 900: 1})
    yield Case("unknown-huge-key", with_pools(huge_key), (*JOB_OBJECT, "spec.training.kkkk", "unknown field"))


def cross_field_cases() -> Iterator[Case]:
    """Each field fine alone, wrong together."""
    arch = "spec.model.architecture"
    yield job_case("preset-unknown", f"{arch}.preset", "llama-9", arch, "unknown preset 'llama-9'")
    yield job_case("preset-huge", f"{arch}.preset", "p" * 120, arch, "unknown preset 'ppp")
    yield job_case("preset-and-sizes", arch, {"preset": "llama-3.1-8b", "hiddenSize": 4096}, arch, "not both")
    yield job_case("heads-not-multiple", f"{arch}.numKeyValueHeads", 7, arch, "multiple", base=CUSTOM)
    yield job_case("hidden-not-divisible", f"{arch}.hiddenSize", 5121, arch, "not divisible", base=CUSTOM)
    yield job_case("experts-per-token-too-many", f"{arch}.expertsPerToken", 2, arch, "expertsPerToken", base=CUSTOM)
    yield job_case("sizes-missing", arch, {"hiddenSize": 4096}, arch, "these sizes are required")
    yield job_case("qlora-zero3", "spec", {**JOB["spec"], "method": "qlora",
                                           "strategy": {"zeroStage": 3, "engine": "deepspeed"}},
                   "spec", "qlora cannot run under DeepSpeed ZeRO-3")  # fmt: skip
    yield job_case("micro-batch-not-dividing", "spec.strategy", {"microBatchSize": 5}, "spec", "not divisible")
    yield job_case("offload-parameters-zero2", "spec.strategy", {"zeroStage": 2, "offloadParameters": "cpu"},
                   "spec", "offloadParameters needs zeroStage 3")  # fmt: skip
    eight_bit = {**JOB["spec"], "training": {**JOB["spec"]["training"], "optimizer": "adamw8bit"},
                 "strategy": {"offloadOptimizer": "cpu"}}  # fmt: skip
    yield job_case("eight-bit-offload", "spec", eight_bit, "spec", "8-bit optimizers")
    yield job_case("lora-target-unknown", "spec.lora.targetModules", ["qkv"], "spec", "qkv")
    yield job_case("source-pvc-and-hub", "spec.dataset.source", {"pvc": "a", "hub": "b/c"}, "spec.dataset.source")
    yield job_case("source-neither", "spec.dataset.source", {}, "spec.dataset.source", "exactly one")
    yield job_case("source-hub-with-path", "spec.model.source.path", "x", "spec.model.source", "`path` goes with")
    yield job_case("source-pvc-with-secret", "spec.dataset.source.tokenSecretRef", {"name": "s"},
                   "spec.dataset.source", "tokenSecretRef")  # fmt: skip
    yield job_case("text-and-messages", "spec.dataset.textField", "text", "spec.dataset", "not both")
    not_declared = with_pools(_set(JOB, "spec.resources.pool", "tpu-v5"))
    yield Case("pool-not-declared", not_declared, ("FineTuneJob 'llama-chat'", "resources.pool 'tpu-v5'"))
    yield pool_case("pool-product-unknown", "spec.gpuProduct", "NVIDIA-Q9000", "spec", "NVIDIA-Q9000", "gpuMemoryGiB")
    yield pool_case("pool-product-mig", "spec.gpuProduct", "NVIDIA-A100-SXM4-80GB-MIG-1g.10gb", "spec", "MIG")


def document_set_cases() -> Iterator[Case]:
    """The right objects in the wrong numbers."""
    second = _set(JOB, "metadata.name", "second")
    yield Case("two-jobs", dump(JOB, second, *POOLS), ("expected one FineTuneJob, found 2",))
    yield Case("no-job", dump(*POOLS), ("expected one FineTuneJob, found 0",))
    yield Case("no-pool", dump(JOB), ("FineTuneJob 'llama-chat'", "no GPUPool is declared"))
    pools = [_set(POOLS[1], "metadata.name", f"l4-{index}") for index in range(101)]
    yield Case("too-many-pools", dump(JOB, *pools), ("101 GPUPools",))
    yield Case("too-many-documents", base_text().encode() + b"---\n" * 1000, ("more than 1000 documents",))
    yield Case("empty-file", b"", ("expected one FineTuneJob, found 0",))
    yield Case("whitespace-only", b"  \n\n  \n", ("expected one FineTuneJob, found 0",))
    yield Case("tabs-only", b"\t\n\t\n", NOT_YAML)
    yield Case("comments-only", b"# nothing here\n# at all\n", ("expected one FineTuneJob, found 0",))
    yield Case("separators-only", b"---\n---\n...\n", ("expected one FineTuneJob, found 0",))


def yaml_cases() -> Iterator[Case]:
    """What is not valid YAML, or not what memfit reads as YAML: aliases, nesting, numbers past 64 bits."""
    text = base_text()

    def edit(name: str, old: str, new: str, *expect: str) -> Case:
        assert old in text, old
        return Case(name, text.replace(old, new, 1).encode(), expect or NOT_YAML)

    yield edit("duplicate-top-level-key", "kind: FineTuneJob\n", "kind: FineTuneJob\nkind: GPUPool\n",
               *NOT_YAML, "duplicate key 'kind'")  # fmt: skip
    yield edit("duplicate-spec-key", "  method: auto\n", "  method: auto\n  method: full\n",
               *NOT_YAML, "duplicate key 'method'")  # fmt: skip
    yield edit("duplicate-metadata-key", "  name: llama-chat\n", "  name: llama-chat\n  name: other\n",
               *NOT_YAML, "duplicate key 'name'")  # fmt: skip
    yield edit("duplicate-nested-key", "    globalBatchSize: 64\n", "    globalBatchSize: 64\n    globalBatchSize: 8\n",
               *NOT_YAML, "duplicate key 'globalBatchSize'")  # fmt: skip
    yield edit("duplicate-flow-key", "  namespace: research\n", "  namespace: research\n  labels: {a: b, a: c}\n",
               *NOT_YAML, "duplicate key 'a'")  # fmt: skip
    laughs = "".join(f"l{i}: &l{i} [{','.join([f'*l{i - 1}'] * 9)}]\n" for i in range(1, 12))
    yield Case("alias-bomb", ('l0: &l0 "lol"\n' + laughs).encode(), (*NOT_YAML, "alias"))
    yield Case("alias-bomb-in-job", (text + "\n---\n" + 'l0: &l0 "lol"\n' + laughs).encode(), (*NOT_YAML, "alias"))
    yield edit(
        "alias-simple",
        "  namespace: research\n",
        "  namespace: research\n  labels: &labels {team: nlp}\n  annotations: *labels\n",
        *NOT_YAML,
        "alias",
    )
    yield edit("alias-merge-key", "  namespace: research\n",
               "  namespace: research\n  labels: &labels {team: nlp}\n  annotations: {<<: *labels}\n", *NOT_YAML,
               "alias")  # fmt: skip
    yield edit("alias-undefined", "globalBatchSize: 64", "globalBatchSize: *batch", *NOT_YAML, "alias")
    yield edit("deep-flow-500", "globalBatchSize: 64", "globalBatchSize: " + "[" * 500 + "]" * 500,
               *NOT_YAML, "nested")  # fmt: skip
    yield edit("deep-flow-mapping-500", "globalBatchSize: 64", "globalBatchSize: " + "{a: " * 500 + "1" + "}" * 500,
               *NOT_YAML, "nested")  # fmt: skip
    deep_block = "".join("  " * (index + 1) + f"k{index}:\n" for index in range(200))
    yield Case("deep-block-200", (text.rstrip() + "\n---\nroot:\n" + deep_block).encode(), (*NOT_YAML, "nested"))
    yield Case("deep-unclosed-100000", ("x: " + "[" * 100_000).encode(), NOT_YAML)
    # The issue's own examples, as written by hand.
    yield edit("issue-huge-global-batch", "globalBatchSize: 64", "globalBatchSize: 4611686018427387904",
               *JOB_OBJECT, "spec.training.globalBatchSize")  # fmt: skip
    yield edit("issue-nodes-exponent", "nodes: 4\n", "nodes: 1e9\n", *POOL_OBJECT, "spec.nodes")
    yield edit("issue-weight-decay-inf", "epochs: 2", "epochs: 2\n    weightDecay: .inf", *JOB_OBJECT,
               "spec.training.weightDecay")  # fmt: skip
    yield edit("issue-epochs-2-to-64", "epochs: 2", f"epochs: {2**64}", *NOT_YAML, "64 bits")
    yield edit("issue-suspend-yes-string", "method: auto", 'method: auto\n  suspend: "yes"', *JOB_OBJECT,
               "spec.suspend")  # fmt: skip
    yield edit("issue-batch-string", "globalBatchSize: 64", 'globalBatchSize: "64"', *JOB_OBJECT,
               "spec.training.globalBatchSize")  # fmt: skip
    yield edit("int-5000-digits", "globalBatchSize: 64", "globalBatchSize: " + "9" * 5000, *NOT_YAML, "64 bits")
    yield edit("int-2-to-64", "globalBatchSize: 64", f"globalBatchSize: {2**64}", *NOT_YAML, "64 bits")
    yield edit("int-minus-2-to-64", "globalBatchSize: 64", f"globalBatchSize: -{2**64}", *NOT_YAML, "64 bits")
    yield edit("int-hex-huge", "globalBatchSize: 64", "globalBatchSize: 0x" + "f" * 40, *NOT_YAML, "64 bits")
    yield edit("int-sexagesimal-long", "globalBatchSize: 64", "globalBatchSize: " + ":".join(["59"] * 50_000),
               *NOT_YAML, "64 bits")  # fmt: skip
    yield edit("tag-python-object", "globalBatchSize: 64", "globalBatchSize: !!python/object/apply:os.system [ls]",
               *NOT_YAML, "constructor")  # fmt: skip
    yield edit("tag-python-name", "globalBatchSize: 64", "globalBatchSize: !!python/name:os.system ''",
               *NOT_YAML, "constructor")  # fmt: skip
    yield edit("tag-binary", "name: llama-chat", "name: !!binary bGxhbWE=", *NOT_YAML, "binary")
    yield edit("tag-set", "targetModules:\n    - all-linear", "targetModules: !!set {all-linear}", *NOT_YAML, ":set")
    yield edit("tag-omap", "targetModules:\n    - all-linear", "targetModules: !!omap [a: 1]", *NOT_YAML, "omap")
    yield edit("tag-pairs", "targetModules:\n    - all-linear", "targetModules: !!pairs [a: 1]", *NOT_YAML, "pairs")
    yield edit("tag-timestamp", "namespace: research", "namespace: !!timestamp 2024-01-01", *NOT_YAML, "timestamp")
    yield edit("tag-custom", "globalBatchSize: 64", "globalBatchSize: !batch 64", *NOT_YAML, "!batch")
    yield edit("tag-long", "globalBatchSize: 64", "globalBatchSize: !" + "t" * 5000 + " 64", *NOT_YAML)
    yield edit("syntax-unclosed-flow", "globalBatchSize: 64", "globalBatchSize: [64", *NOT_YAML)
    yield edit("syntax-unclosed-quote", "name: llama-chat", 'name: "llama-chat', *NOT_YAML)
    yield edit("syntax-bad-escape", "name: llama-chat", 'name: "llama\\qchat"', *NOT_YAML, "escape")
    yield edit("syntax-tab-indent", "  namespace: research", "\tnamespace: research", *NOT_YAML)
    yield edit("syntax-bad-indent", "  namespace: research", "     namespace: research", *NOT_YAML)
    yield edit("syntax-colon-soup", "  method: auto", "  method: : : auto: :", *NOT_YAML)
    yield edit("syntax-unknown-directive-version", "apiVersion", "%YAML 9.9\n---\napiVersion", *NOT_YAML)
    yield edit("syntax-block-in-flow", "targetModules:\n    - all-linear", "targetModules: [- a]", *NOT_YAML)
    yield edit("syntax-sequence-for-mapping", "  method: auto\n", "  - method: auto\n", *NOT_YAML)
    yield edit("syntax-complex-key", "  method: auto", "  ? [a, b]\n  : auto", *NOT_YAML, "unhashable")
    yield edit("syntax-mapping-key", "  method: auto", "  ? {a: 1}\n  : auto", *NOT_YAML, "unhashable")
    yield edit("control-escape-raw", "name: llama-chat", "name: llama\x1b[31mchat", "not valid YAML: line 4")
    yield edit("control-nul-raw", "name: llama-chat", "name: llama\x00chat", "not valid YAML: line 4")
    yield edit("control-bell-raw", "namespace: research", "namespace: re\x07search", "not valid YAML: line 5")
    yield edit("control-del-raw", "namespace: research", "namespace: re\x7fsearch", "not valid YAML: line 5")
    after_unicode = text.replace("name: llama-chat", "name: ll\u00e4m\u00e4-ch\u00e4t", 1)
    yield Case("control-after-unicode", after_unicode.replace("namespace: research", "namespace: re\x01search", 1)
               .encode(), ("not valid YAML: line 5",))  # fmt: skip


def encoding_cases() -> Iterator[Case]:
    text = base_text()
    latin = text.replace("llama-chat", "llama-caf\u00e9", 1)
    yield Case("encoding-latin-1", latin.encode("latin-1"), ("line 4", "not UTF-8"))
    yield Case("encoding-cp1252", text.replace("research", "r\u00e9search\u2019", 1).encode("cp1252"), ("not UTF-8",))
    yield Case("encoding-utf-16", text.encode("utf-16"), ("UTF-16",))
    yield Case("encoding-utf-16-be", codecs.BOM_UTF16_BE + text.encode("utf-16-be"), ("UTF-16",))
    yield Case("encoding-utf-32", text.encode("utf-32"), ("UTF-32",))
    yield Case("encoding-utf-16-no-bom", text.encode("utf-16-le"), ("not valid YAML: line 1",))
    yield Case("encoding-surrogate", text.encode().replace(b"research", b"re\xed\xa0\x80search", 1), ("not UTF-8",))
    yield Case("encoding-overlong", text.encode().replace(b"research", b"re\xc0\xafsearch", 1), ("not UTF-8",))
    yield Case("encoding-truncated", text.encode() + "\u00e9".encode()[:1], ("not UTF-8",))
    generator = random.Random(20240101)
    for index in range(6):
        data = bytes(generator.randrange(256) for _ in range(generator.choice([16, 512, 4096])))
        yield Case(f"binary-random-{index}", data, ())  # the first bad byte decides what the line says
    yield Case("binary-png", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)), ("not UTF-8",))
    yield Case("binary-gzip", b"\x1f\x8b\x08\x00" + bytes(range(200)), ("not UTF-8",))
    yield Case("binary-elf", b"\x7fELF\x02\x01\x01" + bytes(64), ("not valid YAML: line 1",))
    yield Case("binary-nul-bytes", bytes(1000), ("not valid YAML: line 1",))
    yield Case("too-large", text.encode() + b"#" * (5 * 1024 * 1024), ("larger than 4 MiB",))
    yield Case("too-many-values", text.encode() + b"---\n" + b"[" + b"1," * 200_000 + b"1]\n", (*NOT_YAML, "values"))


def echo_cases() -> Iterator[Case]:
    """Names with markup and escape codes, and huge values, in a bad job: the line quotes them literally,
    escaped and cut short."""
    bad = _set(JOB, "spec.training.globalBatchSize", "64")
    for label, name in [("markup", "[/]"), ("markup-bold", "[bold red]x[/bold red]"), ("escape", "\x1b[2J\x1b[H"),
                        ("newline", "a\nb\rc"), ("bidi", "abc\u202edcba"), ("long", "n" * 100_000),
                        ("emoji", "\U0001f680 rocket")]:  # fmt: skip
        yield Case(f"echo-name-{label}", with_pools(_set(bad, "metadata.name", name)),
                   ("(document 1)", "FineTuneJob ", "spec.training.globalBatchSize"))  # fmt: skip
    yield job_case("echo-huge-string-value", "spec.output.pvc", "x" * 1_000_000, "spec.output.pvc")
    yield job_case("echo-huge-list-value", "spec.method", list(range(20_000)), "spec.method")
    yield job_case("echo-nested-value", "spec.method", {"a": {"b": {"c": {"d": [1, [2, [3]]]}}}}, "spec.method")
    yield job_case("echo-escape-in-enum", "spec.method", "\x1b[31mred", "spec.method")
    yield pool_case("echo-escape-in-product", "spec.gpuProduct", "\x1b]0;pwned\x07", "spec")


def valid_cases() -> Iterator[Case]:
    """Edge cases that must plan (exit 0, or 1 when nothing fits)."""
    yield Case("valid-example", with_pools(JOB), valid=True)
    top = _set(CUSTOM, "spec", {
        **CUSTOM["spec"],
        "model": {"name": "giant", "architecture": {"hiddenSize": 131_072, "intermediateSize": 1_048_576,
                  "numLayers": 1024, "numAttentionHeads": 1024, "numKeyValueHeads": 1024, "headDim": 4096,
                  "vocabSize": 4_194_304, "numExperts": 4096, "expertsPerToken": 4096}},
        # dropout at its maximum: on the attention only (peft adapts fused experts without dropout)
        "method": "auto", "lora": {"rank": 4096, "alpha": 1e6, "dropout": 0.99,
                                   "targetModules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
        "training": {"globalBatchSize": 65_536, "sequenceLength": 4_194_304, "epochs": 10_000_000,
                     "maxSteps": 10_000_000, "learningRate": 0.999, "warmupRatio": 0.999, "weightDecay": 10,
                     "maxGradNorm": 1e6, "checkpointEverySteps": 10_000_000, "seed": 2**32 - 1},
        "resources": {"maxGPUs": 640_000, "memoryHeadroomPercent": 89.99}, "strategy": {},
        "maxRestarts": 100, "maxReplans": 100,
    })  # fmt: skip
    biggest = {"apiVersion": "memfit.dev/v1alpha1", "kind": "GPUPool", "metadata": {"name": "biggest"},
               "spec": {"gpuProduct": "X", "gpuMemoryGiB": 4096, "peakTFLOPS": {"bf16": 1e6, "fp16": 1e6},
                        "gpusPerNode": 64, "nodes": 10_000, "cpuMemoryGiBPerNode": 65_536, "nvmeGiBPerNode": 65_536,
                        "nvmeGBpsPerNode": 1e5,
                        "interconnect": {"intraNodeGBps": 1e5, "interNodeGBps": 1e5}}}  # fmt: skip
    wide = _set(_set(_set(biggest, "metadata.name", "wide"), "spec.gpusPerNode", 1), "spec.nodes", 10_000)
    smallest = {"apiVersion": "memfit.dev/v1alpha1", "kind": "GPUPool", "metadata": {"name": "smallest"},
                "spec": {"gpuProduct": "Y", "gpuMemoryGiB": 1 / 16, "peakTFLOPS": {"fp16": 0.01}, "gpusPerNode": 1,
                         "nodes": 1, "cpuMemoryGiBPerNode": 1 / 16, "nvmeGBpsPerNode": 0.01,
                         "interconnect": {"intraNodeGBps": 0.01, "interNodeGBps": 0.01}}}  # fmt: skip
    yield Case("valid-every-field-at-its-maximum", dump(top, biggest, wide, smallest), valid=True)
    many_divisors = _set(_set(JOB, "spec.training.globalBatchSize", 55_440), "spec.resources", {})
    yield Case("valid-batch-of-many-divisors-on-10000-nodes", dump(many_divisors, biggest, wide), valid=True)
    low = _set(JOB, "spec.training", {"globalBatchSize": 1, "sequenceLength": 8, "maxSteps": 1, "seed": 0,
                                      "weightDecay": 0, "warmupRatio": 0, "checkpointEverySteps": 1})  # fmt: skip
    low = _set(_set(low, "spec.lora", {"rank": 1, "alpha": 1, "dropout": 0}), "spec.maxRestarts", 0)
    yield Case("valid-every-field-at-its-minimum", dump(_set(low, "spec.resources", {"pool": "smallest"}), smallest),
               valid=True)  # fmt: skip
    text = base_text()
    yield Case("valid-yaml-1-2-numbers", text.replace("epochs: 2", "epochs: 2\n    learningRate: 2e-5\n"
                                                      "    weightDecay: 1e-2\n    maxGradNorm: 1", 1).encode(),
               valid=True)  # fmt: skip
    yield Case("valid-integer-for-number", with_pools(_set(JOB, "spec.lora.alpha", 32)), valid=True)
    yield Case("valid-anchor-without-alias", text.replace("  namespace: research\n",
                                                          "  namespace: research\n  labels: &l {team: nlp}\n").encode(),
               valid=True)  # fmt: skip
    yield Case("valid-utf-8-bom", codecs.BOM_UTF8 + text.encode(), valid=True)
    yield Case("valid-crlf", text.replace("\n", "\r\n").encode(), valid=True)
    yield Case("valid-unicode", with_pools(_set(JOB, "metadata.annotations", {"note": "caf\u00e9 \U0001f680"})),
               valid=True)  # fmt: skip
    for label, name in [("markup", "[/]x[bold]"), ("escape", "\x1b[31mred"), ("newline", "a\nb")]:
        # The API server refuses such a name: the line says so, the name escaped (no markup, no control).
        yield Case(f"name-with-{label}", with_pools(_set(JOB, "metadata.name", name)),
                   expect=("metadata.name", "is not a valid object name"))  # fmt: skip
    server = _set(JOB, "metadata", {**JOB["metadata"], "uid": "0f1e2d3c", "resourceVersion": "42", "generation": 3,
                                    "creationTimestamp": None, "deletionGracePeriodSeconds": 30,
                                    "finalizers": ["memfit.dev/cleanup"], "generateName": "llama-",
                                    "ownerReferences": [{"apiVersion": "v1", "kind": "ConfigMap", "name": "x",
                                                         "uid": "1"}],
                                    "managedFields": [{"manager": "kubectl", "operation": "Apply",
                                                       "fieldsV1": {"f:spec": {"f:method": {}}}}],
                                    "selfLink": "/apis/memfit.dev/v1alpha1/x"})  # fmt: skip
    yield Case("valid-server-metadata", with_pools(server), valid=True)
    yield Case("valid-unquoted-timestamp", text.replace("  namespace: research\n",
                                                        "  namespace: research\n  annotations: {since: 2024-01-01}\n"
                                                        ).encode(), valid=True)  # fmt: skip
    for label, path in [("root", "/"), ("absolute", "/runs/llama/"), ("dot", "./a/./b"), ("dots", ".../x..y/")]:
        yield Case(f"valid-output-path-{label}", with_pools(_set(JOB, "spec.output.path", path)), valid=True)
    yield Case("valid-empty-documents-around", ("---\n# a comment\n---\n" + text + "---\n...\n").encode(), valid=True)
    yield Case("valid-hundred-pools", dump(JOB, *[_set(POOLS[1], "metadata.name", f"l4-{i}") for i in range(99)],
                                           POOLS[0]), valid=True)  # fmt: skip


GROUPS: list[Callable[[], Iterator[Case]]] = [typed_field_cases, string_field_cases, shape_cases, cross_field_cases,
                                              document_set_cases, yaml_cases, encoding_cases, echo_cases,
                                              valid_cases]  # fmt: skip


def cases() -> list[Case]:
    found = [case for group in GROUPS for case in group()]
    names = [case.name for case in found]
    duplicates = {name for name in names if names.count(name) > 1}
    assert not duplicates, f"case names must be unique: {sorted(duplicates)}"
    return found


def write(directory: Path) -> list[tuple[Case, Path]]:
    """Write every case as DIR/<name>.yaml, and DIR/index.json (name, valid, expected texts)."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for case in cases():
        path = directory / f"{case.name}.yaml"
        path.write_bytes(case.content)
        written.append((case, path))
    index = [{"name": case.name, "valid": case.valid, "expect": list(case.expect)} for case, _ in written]
    (directory / "index.json").write_text(json.dumps(index, indent=1) + "\n")
    return written


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} DIR")
    corpus = write(Path(sys.argv[1]))
    print(f"{len(corpus)} cases ({sum(not c.valid for c, _ in corpus)} bad, {sum(c.valid for c, _ in corpus)} valid)")
