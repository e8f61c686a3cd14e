"""The model-state memory model against what DeepSpeed really allocates, bf16 master weights above all.

tests/deepspeed_allocations.py runs the trainer's own model and engine code under torchrun (2 CPU ranks) with
the DeepSpeed config memfit renders, and sorts every live tensor storage by what holds it (see there). Each
term of ``memfit.memory.states.model_states`` is compared with its measurement, on tiny llama, qwen2 (biases,
tied embeddings) and mistral models, at every ZeRO stage, with bf16 masters (fp32 masters as the control),
for Adam, bitsandbytes' 8-bit Adam (paged and not) and Adafactor, full fine-tuning, LoRA and QLoRA.

Where the CPU run differs from a GPU run it is said at the assertion: DeepSpeed's Lion has no CPU kernel
(not measured here: its one momentum is ``zeros_like(param)`` as Adam's two are); paged optimizers fall back
to ordinary memory on the CPU (these tiny tensors are below the 1e5 elements that would be paged anyway); the
CPU's in-place ``mul_`` of a bf16 gradient by an fp32 clip coefficient goes through an fp32 temporary that CUDA
kernels do not allocate. The table is printed with ``-s``.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import pytest

from memfit.memory.engines.deepspeed import zero3_working_set
from memfit.memory.estimate import model_states
from memfit.memory.setup import Adapters
from memfit.memory.sizes import FP64
from memfit.memory.states import ModelStates, largest_trainable_tensor, trainable_split
from tests.deepspeed_allocations import SHAPES, WORLD_SIZE, Case
from tests.trainer.runs import trainer_env

pytestmark = pytest.mark.distributed
pytest.importorskip("deepspeed")

ARCHITECTURES = ("llama", "qwen2", "mistral")
CASES = [
    *(Case(family, stage) for family in ARCHITECTURES for stage in (0, 1, 2, 3)),
    *(Case("llama", stage, master_weights="fp32") for stage in (0, 1, 2, 3)),
    Case("qwen2", 0, optimizer="adamw8bit"),
    Case("qwen2", 2, optimizer="adamw8bit"),
    Case("qwen2", 0, master_weights="fp32", optimizer="adamw8bit"),
    Case("mistral", 0, optimizer="paged_adamw8bit"),
    Case("mistral", 3, optimizer="paged_adamw8bit"),
    Case("qwen2", 0, optimizer="adafactor"),
    Case("qwen2", 0, master_weights="fp32", optimizer="adafactor"),
    Case("qwen2", 2, optimizer="adafactor"),
    Case("qwen2", 2, master_weights="fp32", optimizer="adafactor"),
    Case("llama", 0, method="lora"),
    Case("llama", 2, method="lora"),
    Case("llama", 0, method="qlora"),
    Case("llama", 2, method="qlora", optimizer="adamw8bit"),
]
ADAPTERS = Adapters(8, ("all-linear",))
TERMS = ("weights", "gradients", "step_gradients", "optimizer_states")


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("allocations")
    cases, out = tmp / "cases.json", tmp / "measured.json"
    cases.write_text(json.dumps([asdict(case) for case in CASES]))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD_SIZE}",
               "-m", "tests.deepspeed_allocations", str(cases), str(out)]  # fmt: skip
    root = Path(__file__).parent.parent
    result = subprocess.run(command, cwd=root, env=trainer_env(), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    results = {Case(**r["case"]).name: r for r in json.loads(out.read_text())}
    print("\n" + table(results))
    return results


def states(case: Case) -> ModelStates:
    return model_states(SHAPES[case.family], case.strategy(), ADAPTERS)


def expected(case: Case) -> dict[str, int]:
    """The model's terms at the moments they are measured: ZeRO-3 weights at rest (its gathered working set
    exists only in forward and backward) and its gradients after the reduce-scatter."""
    shape, s = SHAPES[case.family], states(case)
    zero3 = case.zero_stage == 3
    return {
        "weights": s.parameters - (zero3_working_set(shape) * 2 if zero3 else 0),
        "gradients": s.gradients - (shape.largest_layer_parameters * 2 if zero3 and case.method == "full" else 0),
        "step_gradients": s.step_gradients,
        "optimizer_states": s.optimizer_states,
    }


def measured_terms(results: dict[str, dict[str, Any]], case: Case) -> dict[str, int]:
    """The same terms measured. The step's transient is the larger of the gradient norm's copy (ZeRO-0: the
    clipping's, halved: the CPU's in-place cast temporary, see the module doc) and what the optimizer step
    adds: the gradient partition it is handed and, for Adafactor over bf16, its fp32 upcasts (its step's peak
    less that of the same step over fp32 masters, whose update temporaries are the same)."""
    r = results[case.name]
    norm = r["norm_peak"] // 2 if case.zero_stage == 0 else r["norm_peak"]
    step = r["step_gradients"]
    if case.optimizer == "adafactor" and case.master_weights == "bf16":
        fp32 = results[replace(case, master_weights="fp32").name]
        step += r["optimizer_step_peak"] - fp32["optimizer_step_peak"]
    return {
        "weights": r["weights"],
        "gradients": r["gradients"],
        "step_gradients": max(step, norm),
        "optimizer_states": r["masters"] + r["states"],
    }


def table(results: dict[str, dict[str, Any]]) -> str:
    lines = [f"{'case':42s}" + "".join(f"{t:>30s}" for t in TERMS)]
    for case in CASES:
        got, want = measured_terms(results, case), expected(case)
        cells = []
        for t in TERMS:
            error = (got[t] - want[t]) / want[t] if want[t] else 0.0
            cells.append(f"{got[t]:>9d} / {want[t]:>9d} {error:+7.2%}")
        lines.append(f"{case.name:42s}" + "".join(f"{c:>30s}" for c in cells))
    return "\n".join(lines)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_optimizer_states_and_masters_are_exact(case: Case, measured: dict[str, dict[str, Any]]) -> None:
    """Masters (bf16 or fp32 partitions; none at ZeRO-0 with bf16 masters) and every optimizer state, 8-bit
    blocks, 32-bit fallbacks for small tensors, quantization maps and Adafactor's RMS included."""
    r = measured[case.name]
    assert r["masters"] + r["states"] == expected(case)["optimizer_states"]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_weights(case: Case, measured: dict[str, dict[str, Any]]) -> None:
    want, got = expected(case)["weights"], measured[case.name]["weights"]
    if case.method == "qlora":  # 4.127 bits per 4-bit weight on average; a tiny tensor rounds its scales up
        assert got == pytest.approx(want, rel=0.02)
    else:
        assert got == want


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_step_transient(case: Case, measured: dict[str, dict[str, Any]]) -> None:
    assert measured_terms(measured, case)["step_gradients"] == pytest.approx(
        expected(case)["step_gradients"], rel=0.02, abs=256
    )


def test_the_norm_copies_the_largest_piece_to_fp64(measured: dict[str, dict[str, Any]]) -> None:
    """With bf16 masters the gradient norm's fp64 copy of one gradient piece outgrows the bf16 partition
    under ZeRO-1/2 here (a 16512-element embedding in a 53536-element partition): the step's transient."""
    case = Case("llama", 2)
    r, shape = measured[case.name], SHAPES["llama"]
    largest = largest_trainable_tensor(shape, case.method, ADAPTERS)
    assert r["norm_peak"] == pytest.approx(FP64 * largest, abs=64)
    assert r["norm_peak"] > r["step_gradients"] == 2 * shape.parameter_count // WORLD_SIZE
    assert states(case).step_gradients == FP64 * largest


def test_adafactor_upcasts_bf16_masters(measured: dict[str, dict[str, Any]]) -> None:
    """Adafactor over a bf16 partition adds ``grad.float()`` and ``p.float()`` (8 bytes per element) to the
    step it takes over fp32 masters; its own update temporaries are the same in both."""
    bf16, fp32 = (
        measured[Case("qwen2", 2, optimizer="adafactor").name],
        measured[Case("qwen2", 2, master_weights="fp32", optimizer="adafactor").name],
    )
    partition = trainable_split(SHAPES["qwen2"], "full", ADAPTERS).trainable // WORLD_SIZE
    assert bf16["optimizer_step_peak"] - fp32["optimizer_step_peak"] == pytest.approx(8 * partition, abs=64)
    case = Case("qwen2", 2, optimizer="adafactor")
    assert states(case).step_gradients == (2 + 8) * partition
    assert bf16["step_gradients"] == 2 * partition
    # Under ZeRO Adafactor sees one flat 1-d partition: a full fp32 second moment, not a factored one.
    assert bf16["states"] == 4 * partition + 4


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_gradients(case: Case, measured: dict[str, dict[str, Any]]) -> None:
    """At the end of the backward pass. ZeRO-2 (and ZeRO-1, which in DeepSpeed 0.19 reduces at the end of
    the backward pass) keeps whole gradients of the parameters its partition touches: up to one straddling
    tensor more at each end than the partition, which the tiny models make large; ZeRO-1's model term is the
    peak during the backward pass, when every gradient is still whole."""
    got, want = measured[case.name]["gradients"], expected(case)["gradients"]
    if case.zero_stage in (1, 2):
        shape = SHAPES[case.family]
        partition = 2 * trainable_split(shape, case.method, ADAPTERS).trainable // WORLD_SIZE
        straddling = 2 * 2 * largest_trainable_tensor(shape, case.method, ADAPTERS)
        assert partition <= got <= partition + straddling
        assert want >= partition
    else:
        assert got == pytest.approx(want, rel=0.05)


@pytest.mark.parametrize("case", [c for c in CASES if c.master_weights == "bf16"], ids=lambda c: c.name)
def test_bf16_masters_train_bf16_tensors(case: Case, measured: dict[str, dict[str, Any]]) -> None:
    """The weights stay bf16, the optimizer updates bf16 tensors (the weights themselves at ZeRO-0, without
    DeepSpeed's mixed-precision wrapper) and Adam keeps bf16 moments."""
    r = measured[case.name]
    assert set(r["parameter_dtypes"]) <= {"bfloat16", "uint8"}  # uint8: QLoRA's 4-bit weights
    assert set(r["optimizer_parameter_dtypes"]) <= {"bfloat16"}
    expected_states = {"adamw": {"bfloat16"}, "adafactor": {"float32"}}.get(case.optimizer, {"float32", "uint8"})
    assert set(r["state_dtypes"]) == expected_states
    if case.zero_stage == 0:
        assert r["optimizer"] == r["basic_optimizer"]
    assert math.isfinite(r["loss"])
