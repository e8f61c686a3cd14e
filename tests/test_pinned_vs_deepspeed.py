"""The host memory of offloaded states against the buffers DeepSpeed really pins, and the pod's request.

tests/deepspeed_pinned.py runs the trainer's own model and engine code under torchrun (2 CPU ranks) with the
offloading DeepSpeed config memfit renders, and records every tensor DeepSpeed hands to
``get_accelerator().pin_memory`` (a no-op on the CPU, ``tensor.pin_memory()`` on CUDA: the sizes are a GPU
run's). Each is charged as PyTorch's pinned allocator takes it, rounded up to a power of two, and compared
with :func:`memfit.memory.engines.deepspeed.zero_pinned_buffers`: ZeRO-1 and ZeRO-3 buffer for buffer;
ZeRO-2's per-parameter accumulation buffers depend on where a rank's partition falls, which the model bounds
(its share of every tensor and one straddling tensor more). The table is printed with ``-s``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from memfit.memory.activations import pinned_host_bytes
from memfit.memory.engines.deepspeed import host_pinned_bytes, zero_pinned_buffers
from memfit.memory.estimate import model_states
from memfit.memory.setup import Adapters, StaticSetup
from memfit.memory.states import largest_trainable_tensor
from tests.deepspeed_allocations import SHAPES, WORLD_SIZE
from tests.deepspeed_pinned import OffloadCase
from tests.trainer.runs import trainer_env

pytestmark = pytest.mark.distributed
pytest.importorskip("deepspeed")

CASES = [
    OffloadCase("llama", 1),
    OffloadCase("qwen2", 2),
    OffloadCase("llama", 3, offload_parameters="cpu"),
    OffloadCase("mistral", 3, offload_optimizer="none", offload_parameters="cpu"),
    OffloadCase("llama", 3, method="lora", offload_parameters="cpu"),
]
ADAPTERS = Adapters(8, ("all-linear",))


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("pinned")
    cases, out = tmp / "cases.json", tmp / "measured.json"
    cases.write_text(json.dumps([asdict(case) for case in CASES]))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD_SIZE}",
               "-m", "tests.deepspeed_pinned", str(cases), str(out)]  # fmt: skip
    root = Path(__file__).parent.parent
    result = subprocess.run(command, cwd=root, env=trainer_env(), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    results = {OffloadCase(**r["case"]).name: r["ranks"] for r in json.loads(out.read_text())}
    print("\n" + table(results))
    return results


def modelled(case: OffloadCase) -> int:
    return host_pinned_bytes(zero_pinned_buffers(SHAPES[case.family], StaticSetup.of(case.strategy()), ADAPTERS))


def pinned(rank: dict[str, Any]) -> int:
    """What a rank's pins take in PyTorch's pinned allocator."""
    return sum(pinned_host_bytes(nbytes) for nbytes in rank["pinned"])


def table(results: dict[str, list[dict[str, Any]]]) -> str:
    lines = [f"{'case':56s}{'pinned (rounded) per rank':>34s}{'model':>10s}"]
    for case in CASES:
        ranks = " / ".join(f"{pinned(rank)}" for rank in results[case.name])
        lines.append(f"{case.name:56s}{ranks:>34s}{modelled(case):>10d}")
    return "\n".join(lines)


@pytest.mark.parametrize("case", [c for c in CASES if c.zero_stage != 2], ids=lambda c: c.name)
def test_zero1_and_zero3_pin_the_modelled_buffers(case: OffloadCase, measured: dict[str, Any]) -> None:
    """Buffer for buffer: the same sizes, as many of each, on every rank."""
    buffers = zero_pinned_buffers(SHAPES[case.family], StaticSetup.of(case.strategy()), ADAPTERS)
    expected: Counter[int] = Counter()
    for nbytes, count in buffers:
        expected[int(nbytes)] += int(count)
    for rank in measured[case.name]:
        assert Counter(rank["pinned"]) == expected


def test_zero2_accumulation_buffers_are_bounded(measured: dict[str, Any]) -> None:
    """ZeRO-2 pins a buffer per whole parameter of its partition once it accumulates: each rank's rounded
    bytes are within the model's bound, which exceeds the worst rank by less than the straddling tensor it
    adds (a 16-bit copy of the largest one, the embedding)."""
    case = OffloadCase("qwen2", 2)
    ranks = [pinned(rank) for rank in measured[case.name]]
    assert all(len(rank["pinned"]) > 4 for rank in measured[case.name])  # the accumulation buffers exist
    straddling = pinned_host_bytes(2 * largest_trainable_tensor(SHAPES[case.family], case.method, ADAPTERS))
    assert max(ranks) <= modelled(case) < max(ranks) + straddling


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_host_memory_covers_pins_and_states(case: OffloadCase, measured: dict[str, Any]) -> None:
    """A rank's planned host memory holds its pinned buffers as the allocator rounds them and, where the
    optimizer is offloaded, its pageable states."""
    cpu = model_states(SHAPES[case.family], case.strategy(), ADAPTERS).cpu_per_rank
    for rank in measured[case.name]:
        states = rank["optimizer_states"] if case.offload_optimizer != "none" else 0
        assert cpu >= pinned(rank) + states
