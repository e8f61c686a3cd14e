"""`memfit plan --max-sequence-length`: per pool, the longest sequenceLength the job fits, exactly (one token
more does not fit), with the plan that reaches it; and the command's output and errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from memfit.api.loading import load_documents
from memfit.cli.main import main
from memfit.planner.longest import longest_sequence, with_sequence_length
from memfit.planner.search import best_plan
from tests.planning_fixtures import ONE_A100, RTX_4090, WITH_FLASH_ATTN, job, pool

ROOT = Path(__file__).parent.parent
PEERS = ROOT / "examples" / "peers"


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["plan", *map(str, args)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("method", ["qlora", "lora", "full"])
@pytest.mark.slow
def test_the_longest_length_fits_and_one_token_more_does_not(method: str) -> None:
    spec = job("llama-3.1-8b", method, batch=2)
    pools = [RTX_4090, ONE_A100]
    rows = longest_sequence(spec, pools)
    assert [row.pool for row in rows] == ["rtx", "a100"]
    for row in rows:
        if row.sequence_length is None:
            assert best_plan(with_sequence_length(spec, 8, row.pool), pools) is None
            continue
        assert row.plan is not None and row.plan.strategy.pool == row.pool
        assert best_plan(with_sequence_length(spec, row.sequence_length, row.pool), pools) == row.plan
        assert best_plan(with_sequence_length(spec, row.sequence_length + 1, row.pool), pools) is None


def test_a_bigger_gpu_reaches_longer_sequences() -> None:
    rows = {row.pool: row for row in longest_sequence(job("llama-3.1-8b", "qlora", batch=2), [RTX_4090, ONE_A100])}
    assert rows["rtx"].sequence_length is not None and rows["a100"].sequence_length is not None
    assert rows["a100"].sequence_length > 2 * rows["rtx"].sequence_length


def test_the_table_names_each_pool_with_its_length_and_plan(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, PEERS / "torchtune.yaml", "-i", PEERS / "inventory.yaml", "--job",
                         "llama-3.1-8b-qlora", "--max-sequence-length")  # fmt: skip
    assert code == 0
    documents = load_documents(PEERS / "torchtune.yaml", PEERS / "inventory.yaml")
    spec = next(j for j in documents.jobs if j.metadata.name == "llama-3.1-8b-qlora").spec
    (row,) = longest_sequence(spec, documents.pools)  # the job names its pool
    assert row.sequence_length is not None and row.plan is not None
    assert f"{row.sequence_length:,}" in out and "rtx-4090" in out
    assert "searching the longest sequenceLength on pool rtx-4090" in err


@pytest.mark.slow
def test_json_gives_every_pool(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    document = {"apiVersion": "memfit.dev/v1alpha1", "kind": "FineTuneJob", "metadata": {"name": "j"},
                "spec": job("llama-3.1-8b", "qlora", batch=2).model_dump(by_alias=True, mode="json")}  # fmt: skip
    path.write_text(json.dumps(document))
    code, out, _ = run(capsys, path, "-i", PEERS / "inventory.yaml", "--max-sequence-length", "-o", "json")
    assert code == 0
    rows = json.loads(out)
    pools = [pool.metadata.name for pool in load_documents(PEERS / "inventory.yaml").pools]
    assert len(pools) > 1 and [row["pool"] for row in rows] == pools  # in the inventory's order
    for row in rows:
        assert row["sequenceLength"] >= 8 and row["plan"]["strategy"]["pool"] == row["pool"]


def test_it_cannot_be_combined_with_emit_ds_config(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    ds_config = tmp_path / "ds.json"
    code, _, err = run(capsys, PEERS / "torchtune.yaml", "-i", PEERS / "inventory.yaml", "--job",
                       "llama-3.1-8b-qlora", "--max-sequence-length", "--emit-ds-config", ds_config)  # fmt: skip
    assert code == 2 and "--emit-ds-config writes one plan's config" in err
    assert not ds_config.exists()


def test_an_unknown_pool_is_bad_input(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    spec = job("llama-3.1-8b", "qlora", batch=2, resources={"pool": "nowhere"})
    path.write_text(json.dumps({"apiVersion": "memfit.dev/v1alpha1", "kind": "FineTuneJob", "metadata": {"name": "j"},
                                "spec": spec.model_dump(by_alias=True, mode="json")}))  # fmt: skip
    code, _, err = run(capsys, path, "-i", PEERS / "inventory.yaml", "--max-sequence-length")
    assert code == 2 and "resources.pool 'nowhere' is not a declared GPUPool" in err


LONG_CONTEXT = [
    # Issue 23's figures, after ALST (DeepSpeed Ulysses, tiled MLP, checkpoint offload) on H100 80GB: one sequence
    # per step, full fine-tuning in bf16, hosts as large as ALST's were or a little smaller; flash-attn installed,
    # as ALST's recipe has it.
    (pool("h100-x8", "NVIDIA-H100-80GB-HBM3", 8, 1, 1536), 1_048_576),
    (pool("h100-x1", "NVIDIA-H100-80GB-HBM3", 1, 1, 400), 300_000),
]


@pytest.mark.parametrize(("gpus", "at_least"), LONG_CONTEXT, ids=["8xH100", "1xH100"])
@pytest.mark.slow
def test_llama_8b_full_reaches_the_long_context_figures(gpus: Any, at_least: int) -> None:
    spec = job("llama-3.1-8b", "full", training={"globalBatchSize": 1, "precision": "bf16"})
    (row,) = longest_sequence(spec, [gpus], runtime=WITH_FLASH_ATTN)
    assert row.sequence_length is not None and row.sequence_length >= at_least, row
