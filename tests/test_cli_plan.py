"""`memfit plan` as a user meets it: exit codes, the JSON contract, and one clear line per bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from memfit.api.loading import load_documents
from memfit.cli.exit_codes import ExitCode
from memfit.cli.main import main
from memfit.render.deepspeed import deepspeed_config

ROOT = Path(__file__).parent.parent
JOB = ROOT / "examples" / "llama-3.1-8b-lora.yaml"
INVENTORY = ROOT / "examples" / "inventory.yaml"

CANDIDATE_KEYS = {
    "strategy",
    "parameterCount",
    "trainableParameterCount",
    "memory",
    "gpuMemoryBytes",
    "fits",
    "throughput",
    "techniques",
}
STRATEGY_KEYS = {"method", "pool", "nodes", "gpusPerNode", "zeroStage", "offloadOptimizer", "offloadParameters",
                 "gradientCheckpointing", "microBatchSize", "gradientAccumulationSteps", "precision", "optimizer",
                 "attention", "chunkedLoss", "activationOffloading", "masterWeights", "engine",
                 "optimizerInBackward", "sequenceParallel", "tiledMlp", "packing"}  # fmt: skip
PER_GPU_KEYS = {
    "parameters", "gradients", "optimizerStates", "activations", "overhead", "peakAllocatedBytes", "total",
    "activationPeak",
}  # fmt: skip


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["plan", *map(str, args)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_table_shows_the_chosen_plan_and_its_memory(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, JOB, "-i", INVENTORY)
    assert code == 0
    for text in ("Fits", "Memory per GPU (estimate)", "activations", "total", "Throughput (estimate)", "Runner-up"):
        assert text in out


def test_json_is_the_documented_contract(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, JOB, "-i", INVENTORY, "-o", "json")
    assert code == 0
    result = json.loads(out)
    assert {"chosen", "candidates", "rejected", "planningSeconds"} <= set(result)
    chosen = result["chosen"]
    assert set(chosen) == CANDIDATE_KEYS
    assert set(chosen["strategy"]) == STRATEGY_KEYS
    assert set(chosen["memory"]["perGPU"]) == PER_GPU_KEYS
    assert set(chosen["memory"]["perNode"]) == {"cpu", "nvme"}
    assert set(chosen["throughput"]) == {"tokensPerSecond", "stepSeconds"}
    assert result["candidates"][0] == chosen
    assert all("reason" in r and r["fits"] is False for r in result["rejected"])


def test_yaml_output_parses(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, JOB, "-i", INVENTORY, "-o", "yaml")
    assert code == 0 and yaml.safe_load(out)["chosen"]["fits"] is True


def test_nothing_fits_exits_1_and_still_explains(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    job = yaml.safe_load(JOB.read_text())
    job["spec"]["model"]["architecture"] = {"preset": "llama-3.1-70b"}
    job["spec"]["method"] = "full"
    job["spec"]["resources"] = {"pool": "l4"}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    code, out, _ = run(capsys, path, "-i", INVENTORY, "-o", "json")
    result = json.loads(out)
    assert code == 1
    assert result["chosen"] is None and result["rejected"] and result["advice"]


def test_emit_ds_config_writes_what_the_operator_renders(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    target = tmp_path / "ds.json"
    code, out, _ = run(capsys, JOB, "-i", INVENTORY, "-o", "json", "--emit-ds-config", target)
    assert code == 0
    written = json.loads(target.read_text())
    chosen = json.loads(out)["chosen"]["strategy"]
    from pydantic import TypeAdapter

    from memfit.api.plan import Strategy

    job = load_documents(JOB).jobs[0]
    assert written == deepspeed_config(job.spec, TypeAdapter(Strategy).validate_python(chosen))
    assert written["train_batch_size"] == 64
    assert written["train_micro_batch_size_per_gpu"] == chosen["microBatchSize"]
    assert written["zero_optimization"]["stage"] == chosen["zeroStage"]


def edited(tmp_path: Path, change) -> Path:  # type: ignore[no-untyped-def]
    job = yaml.safe_load(JOB.read_text())
    change(job["spec"])
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


BAD_INPUTS = {
    "unknown field": (
        lambda s: s["training"].update(globalBatchSzie=8),
        "spec.training.globalBatchSzie: unknown field",
    ),
    "wrong type": (lambda s: s["training"].update(sequenceLength="long"), "spec.training.sequenceLength"),
    "not divisible": (
        lambda s: (s["training"].update(globalBatchSize=30), s.update(strategy={"microBatchSize": 4})),
        "globalBatchSize (30) is not divisible by strategy.microBatchSize (4)",
    ),
    "unknown preset": (lambda s: s["model"].update(architecture={"preset": "llama-9"}), "unknown preset 'llama-9'"),
    "bad method": (lambda s: s.update(method="dora"), "spec.method: Input should be 'auto', 'full', 'lora' or 'qlora'"),
    "bad lora target": (lambda s: s["lora"].update(targetModules=["qkv"]), "unknown LoRA target module(s) qkv"),
    "zero3 qlora": (
        lambda s: s.update(method="qlora", strategy={"zeroStage": 3, "engine": "deepspeed"}),
        "qlora cannot run under DeepSpeed ZeRO-3",
    ),
    # What the trainer's preflight would refuse from the spec alone, refused before any pod starts.
    "streaming without maxSteps": (
        lambda s: s["dataset"].update(streaming=True),
        "dataset.streaming has no known epoch length: set training.maxSteps",
    ),
    "randomInit below the byte tokenizer": (
        lambda s: s["model"].update(
            randomInit=True,
            architecture={
                "family": "llama",
                "hiddenSize": 64,
                "intermediateSize": 128,
                "numLayers": 2,
                "numAttentionHeads": 4,
                "vocabSize": 100,
            },
        ),
        "vocabSize 100 is below the 258 ids of the byte-level tokenizer randomInit models use",
    ),  # fmt: skip
    "packing a linear-attention model": (
        lambda s: (s["model"].update(architecture={"preset": "qwen3.5-27b"}), s["dataset"].update(packing=True)),
        "dataset.packing: this model's linear-attention layers (Gated DeltaNet...) would carry their state",
    ),
}


@pytest.mark.parametrize(
    ("section", "key", "meant"),
    [
        ("training", "globalBatchSzie", "globalBatchSize"),
        ("training", "sequence_length", "sequenceLength"),
        ("architecture", "hidden_size", "hiddenSize"),
        ("architecture", "num_hidden_layers", "numLayers"),
        ("architecture", "num_experts_per_tok", "expertsPerToken"),
        ("lora", "target_modules", "targetModules"),
    ],
)
def test_an_unknown_field_names_the_field_it_probably_meant(
    section: str, key: str, meant: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A typo, or a key copied from config.json in its snake_case: the line names the field to use."""
    where = (lambda s: s["model"]["architecture"]) if section == "architecture" else (lambda s: s[section])
    code, _, err = run(capsys, edited(tmp_path, lambda s: where(s).update({key: 1})), "-i", INVENTORY)
    assert code == 2 and err.count("\n") == 1
    assert f"{key}: unknown field; did you mean `{meant}`?" in err, err


def test_an_unknown_field_like_none_says_where_the_fields_are(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, _, err = run(capsys, edited(tmp_path, lambda s: s["training"].update(zzz=1)), "-i", INVENTORY)
    assert code == 2 and "spec.training.zzz: unknown field (check the spelling; `memfit crd` shows every field)" in err


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_exits_2_with_one_clear_line(case: str, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    change, expected = BAD_INPUTS[case]
    code, out, err = run(capsys, edited(tmp_path, change), "-i", INVENTORY)
    assert code == 2 and out == ""
    assert expected in err
    assert "Traceback" not in err and err.count("\n") == 1


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("name", "My_Job", "metadata.name: 'My_Job' is not a valid object name"),
        ("name", "spaces in it", "is not a valid object name"),
        ("name", "-leading", "is not a valid object name"),
        ("name", "trailing-", "is not a valid object name"),
        ("name", "ünïcode", "is not a valid object name"),
        ("name", "a" * 254, "at most 253"),
        ("namespace", "Research", "metadata.namespace: 'Research' is not a valid namespace"),
        ("namespace", "a.b", "is not a valid namespace"),
        ("namespace", "a" * 64, "at most 63"),
    ],
)
def test_names_the_api_server_would_refuse_exit_2_naming_the_field(
    field: str, value: str, expected: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    job = yaml.safe_load(JOB.read_text())
    job["metadata"][field] = value
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    code, out, err = run(capsys, path, "-i", INVENTORY)
    assert code == 2 and out == "" and expected in err and err.count("\n") == 1, err


def test_a_name_the_api_server_takes_is_taken(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    job = yaml.safe_load(JOB.read_text())
    job["metadata"].update(name="chat.v2-" + "a" * 200, namespace="team-" + "b" * 50)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    assert run(capsys, path, "-i", INVENTORY)[0] == 0


@pytest.mark.parametrize("kind", ["pool", "job"])
def test_one_name_declared_twice_exits_2_naming_both_places(
    kind: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Applied, the second would replace the first: memfit says so instead of planning one of them."""
    source = INVENTORY if kind == "pool" else JOB
    twice = tmp_path / "twice.yaml"
    twice.write_text(source.read_text() + "\n---\n" + source.read_text())
    args = (JOB, "-i", twice) if kind == "pool" else (twice, "-i", INVENTORY)
    code, out, err = run(capsys, *args)
    assert code == 2 and out == "" and "is declared twice (first in" in err and err.count("\n") == 1, err
    assert "(document 1)" in err


def test_an_ambiguous_gpu_product_is_refused_naming_the_cards(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """`A100` is sold with 40 and 80 GB: memfit does not plan for the smaller card without a word."""
    inventory = tmp_path / "pools.yaml"
    inventory.write_text(INVENTORY.read_text().replace("NVIDIA-A100-SXM4-80GB", "A100"))
    code, out, err = run(capsys, JOB, "-i", inventory)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "'A100' names several cards" in err and "NVIDIA-A100-SXM4-80GB (80 GiB)" in err


T4_POOL = """apiVersion: memfit.dev/v1alpha1
kind: GPUPool
metadata: {name: t4}
spec: {gpuProduct: Tesla-T4, gpusPerNode: 4, nodes: 1, cpuMemoryGiBPerNode: 256}
"""


def test_flash_attention_pinned_where_no_pool_is_ampere_is_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """flash-attention 2 has no kernels before Ampere: the trainer would fail at its first step."""
    inventory = tmp_path / "t4.yaml"
    inventory.write_text(T4_POOL)
    job = edited(tmp_path, lambda s: s.update(method="lora", strategy={"attention": "flash"}))
    code, out, err = run(capsys, job, "-i", inventory, "--trainer-packages", "flash-attn")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "strategy.attention flash" in err and "t4 (Tesla-T4)" in err


def test_flash_attention_pinned_where_the_trainer_lacks_flash_attn_is_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """memfit's trainer image has no flash-attn: without --trainer-packages a pinned flash cannot run anywhere."""
    job = edited(tmp_path, lambda s: s.update(method="lora", strategy={"attention": "flash"}))
    code, out, err = run(capsys, job, "-i", INVENTORY)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "strategy.attention flash: the trainer has no flash-attn" in err
    code, out, err = run(capsys, job, "-i", INVENTORY, "--trainer-packages", "flash-atn")
    assert code == 2 and "unknown kernel package flash-atn" in err


def test_flash_attention_pinned_plans_on_the_ampere_pool_of_several(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    inventory = tmp_path / "pools.yaml"
    inventory.write_text(T4_POOL + "---\n" + INVENTORY.read_text())
    job = edited(tmp_path, lambda s: s.update(method="lora", strategy={"attention": "flash"}))
    code, out, _ = run(capsys, job, "-i", inventory, "-o", "json", "--trainer-packages", "flash-attn")
    result = json.loads(out)
    assert code == 0 and result["chosen"]["strategy"]["attention"] == "flash"
    assert all(c["strategy"]["pool"] != "t4" for c in [*result["candidates"], *result["rejected"]])


def test_a_gpu_alias_is_planned_as_one_card_and_the_table_says_which(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    inventory = tmp_path / "pools.yaml"
    inventory.write_text(INVENTORY.read_text().replace("NVIDIA-A100-SXM4-80GB", "a100-80gb"))
    code, out, _ = run(capsys, JOB, "-i", inventory)
    assert code == 0
    assert "GPUs: pool 'a100-80gb': gpuProduct 'a100-80gb' is NVIDIA-A100-SXM4-80GB (80 GiB)" in out
    code, out, _ = run(capsys, JOB, "-i", INVENTORY)
    assert code == 0 and "GPUs:" not in out  # the product table's own label needs no reading


def test_unknown_gpu_product_names_the_field(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    inventory = tmp_path / "pools.yaml"
    inventory.write_text(INVENTORY.read_text().replace("NVIDIA-L4", "NVIDIA-Q9000"))
    code, _, err = run(capsys, JOB, "-i", inventory)
    assert code == 2 and "GPUPool 'l4'" in err and "NVIDIA-Q9000" in err and "gpuMemoryGiB" in err


@pytest.mark.parametrize(
    "content, expected",
    [("a: [1,", "not valid YAML"), ("apiVersion: v1\nkind: Pod\n", "kind 'Pod' is not one memfit reads"),
     ("apiVersion: memfit.dev/v2\nkind: GPUPool\n", "apiVersion must be memfit.dev/v1alpha1")],
)  # fmt: skip
def test_unreadable_documents(content: str, expected: str, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "x.yaml"
    path.write_text(content)
    code, _, err = run(capsys, JOB, "-i", path)
    assert code == 2 and expected in err


def test_missing_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = run(capsys, tmp_path / "nope.yaml")
    assert code == 2 and "cannot read" in err


@pytest.mark.slow
def test_console_script_is_installed() -> None:
    completed = subprocess.run(
        [Path(sys.executable).parent / "memfit", "plan", JOB, "-i", INVENTORY, "-o", "json"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr
    assert json.loads(completed.stdout)["chosen"]["fits"]


@pytest.mark.parametrize("example", sorted(p.name for p in (ROOT / "examples").glob("*.yaml") if p != INVENTORY))
def test_every_example_job_plans(example: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, ROOT / "examples" / example, "-i", INVENTORY, "-o", "json")
    assert code == 0, err
    assert json.loads(out)["chosen"]["fits"]


def test_an_internal_error_is_one_line_and_exit_3(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug is not bad input (2) nor "nothing fits" (1): one escaped line, the traceback only with --debug."""
    import memfit.cli.plan_command

    def broken(*_: object, **__: object) -> None:
        raise RuntimeError("boom\n\x1b[31m[bold]red")

    monkeypatch.setattr(memfit.cli.plan_command, "plan_job", broken)
    code, out, err = run(capsys, JOB, "-i", INVENTORY)
    assert code == ExitCode.INTERNAL_ERROR == 3 and out == ""
    line = "memfit: internal error: RuntimeError: boom\\n\\x1b[31m[bold]red"
    assert err == f"{line} (run `memfit --debug ...` for the traceback)\n"
    for argv in (
        ["--debug", "plan", str(JOB), "-i", str(INVENTORY)],
        ["plan", "--debug", str(JOB), "-i", str(INVENTORY)],
    ):
        assert main(argv) == 3
        err = capsys.readouterr().err
        assert err.startswith("Traceback") and err.endswith(
            "memfit: internal error: RuntimeError: boom\\n\\x1b[31m[bold]red\n"
        )


def test_ctrl_c_exits_130(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import memfit.cli.plan_command

    def interrupted(*_: object, **__: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(memfit.cli.plan_command, "plan_job", interrupted)
    code, _, err = run(capsys, JOB, "-i", INVENTORY)
    assert code == ExitCode.INTERRUPTED == 130 and err == "memfit: interrupted\n"


def test_an_unwritable_ds_config_is_bad_input(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = run(capsys, JOB, "-i", INVENTORY, "-o", "json", "--emit-ds-config", tmp_path / "no" / "ds.json")
    assert code == 2 and err.count("\n") == 1 and "cannot write" in err and "ds.json" in err


def test_an_error_prints_names_literally(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Markup is not interpreted and control characters are escaped: the terminal sees what the file says."""
    job = yaml.safe_load(JOB.read_text())
    job["metadata"]["name"] = "[/]\x1b[2J"
    job["spec"]["training"]["globalBatchSize"] = "64"
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    code, _, err = run(capsys, path, "-i", INVENTORY)
    assert code == 2 and "FineTuneJob '[/]\\x1b[2J': metadata.name: '[/]\\x1b[2J' is not a valid object name" in err
    assert "; spec.training.globalBatchSize: Input should be a valid integer, got '64'" in err


def test_emit_ds_config_says_an_fsdp2_plan_has_none(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    document = yaml.safe_load(JOB.read_text())
    document["spec"]["strategy"] = {"engine": "fsdp2"}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(document))
    target = tmp_path / "ds.json"
    code, out, err = run(capsys, path, "-i", INVENTORY, "--emit-ds-config", target)
    assert code == 0 and "fsdp2" in out
    assert "runs on the fsdp2 engine, which has no DeepSpeed config: nothing written" in err
    assert not target.exists()
