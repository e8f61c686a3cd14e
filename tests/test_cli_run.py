"""`memfit run --local`: planning for this machine, rendering the trainer's config and checking it before
torchrun starts (the training itself is exercised in tests/trainer)."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from memfit.api.base import Source, VolumePath
from memfit.api.finetunejob import FineTuneJob
from memfit.api.gpupool import pool_capacity
from memfit.api.loading import load_documents
from memfit.cli import run_command
from memfit.cli.local_machine import CPU_PRODUCT, LocalMachine, local_pool
from memfit.cli.main import main
from memfit.cli.run_command import launch_check
from memfit.contract.engines import DeepSpeedEngineSection
from memfit.contract.reader import load_config
from memfit.units import GIB

ROOT = Path(__file__).parent.parent
TINY = ROOT / "examples" / "tiny"


@pytest.fixture(autouse=True)
def stand_in_launch_check(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The launch check is a trainer process (seconds: torch, the tokenizer, the data): the tests marked slow
    run it; the others, of planning and paths, stand in one that refuses nothing."""
    if request.node.get_closest_marker("slow") is None:
        monkeypatch.setattr(run_command, "launch_check", lambda config_path, env: None)


@pytest.fixture
def tiny_job(tmp_path: Path) -> Path:
    shutil.copytree(TINY / "data", tmp_path / "data")
    shutil.copy(TINY / "job.yaml", tmp_path / "job.yaml")
    return tmp_path / "job.yaml"


def test_dry_run_renders_the_trainer_config_for_local_directories(tiny_job: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["run", str(tiny_job), "--local", "--nproc", "2", "--dry-run"]) == 0
    out = capsys.readouterr().out
    config = load_config(tiny_job.parent / "output" / "tiny" / ".memfit" / "trainer-config.json")
    assert "memfit run: full zero" in out
    assert config.world_size == 2
    assert config.data.path == str(tiny_job.parent / "data" / "train.jsonl")
    assert config.output_dir == str(tiny_job.parent / "output" / "tiny")
    assert config.model.random_init and config.model.architecture and config.model.architecture.num_layers == 4
    assert isinstance(config.engine, DeepSpeedEngineSection) and config.engine.config["train_batch_size"] == 8
    assert config.metrics.progress_file and config.metrics.progress_file.endswith("progress.json")


def test_mount_maps_a_claim_to_a_directory(tiny_job: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    shutil.move(tiny_job.parent / "data", elsewhere)
    assert main(["run", str(tiny_job), "--local", "--mount", f"data={elsewhere}", "--dry-run"]) == 0
    config = load_config(tiny_job.parent / "output" / "tiny" / ".memfit" / "trainer-config.json")
    assert config.data.path == str(elsewhere / "train.jsonl")


def test_run_without_local_is_refused(tiny_job: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["run", str(tiny_job)]) == 2
    assert "kubectl apply" in capsys.readouterr().err


def test_bad_mount_is_one_clear_line(tiny_job: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["run", str(tiny_job), "--local", "--mount", "data", "--dry-run"]) == 2
    assert "expected CLAIM=DIRECTORY" in capsys.readouterr().err


def test_cpu_machine_becomes_a_pool_of_cpu_processes() -> None:
    machine = LocalMachine((), (), memory_bytes=20 * GIB, cpus=4)
    capacity = pool_capacity(local_pool(machine, ranks=2))
    assert capacity.product == CPU_PRODUCT and capacity.gpus_per_node == 2
    assert capacity.gpu_memory_bytes == pytest.approx(0.8 * 20 * GIB / 2, rel=1e-6)


def test_gpu_machine_uses_the_product_table() -> None:
    machine = LocalMachine(("NVIDIA A100-SXM4-80GB",) * 2, (81920,) * 2, memory_bytes=200 * GIB, cpus=32)
    capacity = pool_capacity(local_pool(machine, ranks=2))
    assert capacity.product == "NVIDIA-A100-SXM4-80GB" and capacity.bf16
    assert capacity.peak_flops_bf16 == pytest.approx(312e12)
    with pytest.raises(ValueError, match="has 2 GPU"):
        local_pool(machine, ranks=4)


# --- paths stay inside their claim's directory (defence in depth: also for a job the API never validated) ---


def unvalidated(job_file: Path, **spec: Any) -> FineTuneJob:
    """The job of ``job_file`` with parts of its spec replaced without any validation (``model_construct``),
    as if the API's own checks had been bypassed."""
    job = load_documents(job_file).jobs[0]
    return job.model_copy(update={"spec": job.spec.model_copy(update=spec)})


@pytest.fixture
def nested_job(tmp_path: Path) -> Path:
    """The tiny job one level down, so that a path escaping its directory lands in ``tmp_path``."""
    jobs = tmp_path / "jobs"
    shutil.copytree(TINY / "data", jobs / "data")
    shutil.copy(TINY / "job.yaml", jobs / "job.yaml")
    return jobs / "job.yaml"


def outside(tmp_path: Path) -> set[str]:
    """What exists beside the job's directory (nothing may be written there)."""
    return {p.name for p in tmp_path.iterdir()} - {"jobs"}


@pytest.mark.parametrize(
    "output",
    [
        VolumePath.model_construct(pvc="output", path="../../escape"),
        VolumePath.model_construct(pvc="output", path="/../escape"),
        VolumePath.model_construct(pvc=str(Path("/tmp") / "memfit-escape-claim"), path="x"),
        VolumePath.model_construct(pvc="../escape", path="x"),
        VolumePath.model_construct(pvc="..", path="escape"),
        VolumePath.model_construct(pvc="output", path="tiny\x00"),
    ],
    ids=["dotdot-path", "rooted-dotdot-path", "absolute-claim", "dotdot-claim", "parent-claim", "nul-path"],
)
def test_an_unvalidated_output_cannot_leave_the_jobs_directory(
    nested_job: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    output: VolumePath,
) -> None:  # fmt: skip
    job = unvalidated(nested_job, output=output)
    monkeypatch.setattr(run_command, "single_job", lambda path, name: job)
    assert main(["run", str(nested_job), "--local", "--nproc", "2", "--dry-run"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("memfit run: error: ")
    assert outside(tmp_path) == set()
    assert not Path("/tmp/memfit-escape-claim").exists()


def test_an_unvalidated_data_path_cannot_leave_its_claim(
    nested_job: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    job = load_documents(nested_job).jobs[0]
    dataset = job.spec.dataset.model_copy(update={"source": Source.model_construct(pvc="data", path="../../x")})
    job = unvalidated(nested_job, dataset=dataset)
    monkeypatch.setattr(run_command, "single_job", lambda path, name: job)
    assert main(["run", str(nested_job), "--local", "--nproc", "2", "--dry-run"]) == 2
    assert "climbs out" in capsys.readouterr().err


def test_a_job_file_with_dotdot_in_its_output_path_is_refused(nested_job: Path, tmp_path: Path) -> None:
    nested_job.write_text(nested_job.read_text().replace("path: tiny/", "path: ../../escape"))
    assert main(["run", str(nested_job), "--local", "--dry-run"]) == 2
    assert outside(tmp_path) == set()


def test_a_claim_directory_leading_out_of_the_jobs_directory_is_refused(
    nested_job: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "elsewhere").mkdir()
    (nested_job.parent / "output").symlink_to(tmp_path / "elsewhere")
    assert main(["run", str(nested_job), "--local", "--dry-run"]) == 2
    assert "outside" in capsys.readouterr().err and not any((tmp_path / "elsewhere").iterdir())
    # The same directory named explicitly is the user's choice: the claim's directory, inside which paths stay.
    assert main(["run", str(nested_job), "--local", "--mount", f"output={tmp_path / 'elsewhere'}", "--dry-run"]) == 0
    assert (tmp_path / "elsewhere" / "tiny" / ".memfit" / "trainer-config.json").is_file()


@pytest.mark.parametrize("link", ["output/tiny", "output/tiny/.memfit"])
def test_a_symlink_inside_the_claim_leading_out_is_refused(
    nested_job: Path, tmp_path: Path, link: str, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "elsewhere").mkdir()
    planted = nested_job.parent / link
    planted.parent.mkdir(parents=True)
    planted.symlink_to(tmp_path / "elsewhere")
    assert main(["run", str(nested_job), "--local", "--dry-run"]) == 2
    assert "outside" in capsys.readouterr().err
    assert not any((tmp_path / "elsewhere").iterdir())


def test_a_planted_config_symlink_is_replaced_not_followed(nested_job: Path, tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    workdir = nested_job.parent / "output" / "tiny" / ".memfit"
    workdir.mkdir(parents=True)
    (workdir / "trainer-config.json").symlink_to(victim)
    (workdir / "termination-log").symlink_to(victim)  # the trainer writes it in place: the link goes
    assert main(["run", str(nested_job), "--local", "--dry-run"]) == 0
    assert victim.read_text() == "precious\n"
    assert not (workdir / "trainer-config.json").is_symlink() and not (workdir / "termination-log").exists()
    assert load_config(workdir / "trainer-config.json").job == "default/tiny"
    assert [p.name for p in workdir.iterdir()] == ["trainer-config.json"]  # no temporary file left


def test_a_mount_must_name_a_claim(tiny_job: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", str(tiny_job), "--local", "--mount", f"../data={tiny_job.parent}", "--dry-run"]) == 2
    assert "not a PersistentVolumeClaim name" in capsys.readouterr().err


def test_the_rendered_config_names_its_volumes(tiny_job: Path) -> None:
    assert main(["run", str(tiny_job), "--local", "--dry-run"]) == 0
    config = load_config(tiny_job.parent / "output" / "tiny" / ".memfit" / "trainer-config.json")
    assert config.volumes is not None
    assert (config.volumes.data, config.volumes.output) == (
        str(tiny_job.parent / "data"),
        str(tiny_job.parent / "output"),
    )
    assert config.volumes.model is None  # random init: no model volume


TINY_SHAPE = {
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 352,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 258,
}
"""examples/tiny's architecture, as a config.json states it."""


@pytest.fixture
def claimed_model_job(tiny_job: Path) -> Path:
    """The tiny job loading its model from the `models` claim (models/tiny beside the job file)."""
    text = tiny_job.read_text()
    assert "    randomInit: true\n" in text
    tiny_job.write_text(text.replace("    randomInit: true\n", "    source: {pvc: models, path: tiny}\n"))
    return tiny_job


def model_dir(job: Path, config: dict[str, Any] | None) -> Path:
    directory = job.parent / "models" / "tiny"
    directory.mkdir(parents=True)
    if config is not None:
        (directory / "config.json").write_text(json.dumps(config))
    return directory


def no_torchrun(*args: Any) -> int:
    raise AssertionError("torchrun started")


def test_a_model_directory_of_the_planned_shape_is_accepted(claimed_model_job: Path) -> None:
    model_dir(claimed_model_job, TINY_SHAPE)
    assert main(["run", str(claimed_model_job), "--local", "--nproc", "2", "--dry-run"]) == 0


def test_a_model_directory_of_another_shape_is_refused_before_torchrun(
    claimed_model_job: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = model_dir(claimed_model_job, {**TINY_SHAPE, "hidden_size": 64, "num_hidden_layers": 2})
    monkeypatch.setattr(run_command, "_torchrun", no_torchrun)
    assert main(["run", str(claimed_model_job), "--local", "--nproc", "2"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    held, planned = line.split(" but ")
    assert str(directory.resolve()) in held and "hidden_size 64" in held and "2 layers" in held
    assert "hidden_size 128" in planned and "4 layers" in planned
    assert not (claimed_model_job.parent / "output").exists()  # nothing written to the output claim


@pytest.mark.parametrize("config", [None, "absent"], ids=["no-config-json", "no-directory"])
def test_a_model_directory_without_config_json_is_refused(
    claimed_model_job: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], config: str | None
) -> None:
    if config is None:
        model_dir(claimed_model_job, None)
    monkeypatch.setattr(run_command, "_torchrun", no_torchrun)
    assert main(["run", str(claimed_model_job), "--local", "--nproc", "2"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("memfit run: error: model directory ")
    assert "config.json" in line if config is None else "does not exist" in line
    assert not (claimed_model_job.parent / "output").exists()


def test_relay_withholds_what_follows_a_ranks_refusal(capsys: pytest.CaptureFixture[str]) -> None:
    stream = io.BytesIO(b"a warning\nmemfit-train: bad config\nmemfit-train: bad config\nTraceback (most recent)\n")
    assert run_command.relay_stderr(stream) == "bad config"
    assert capsys.readouterr().err == "a warning\n"
    assert run_command.relay_stderr(io.BytesIO(b"Traceback\nboom\n")) is None
    assert capsys.readouterr().err == "Traceback\nboom\n"


@pytest.mark.slow
def test_a_trainer_start_up_refusal_arrives_as_its_one_line(tiny_job: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", str(tiny_job), "--local", "--nproc", "2", "--dry-run"]) == 0
    workdir = tiny_job.parent / "output" / "tiny" / ".memfit"
    (workdir / "termination-log").write_text('{"reason": "ConfigError", "message": "an earlier run"}')
    capsys.readouterr()
    # Planned for 2 ranks, started as 1: every rank's preflight refuses the config (exit 2).
    code = run_command._torchrun(
        workdir / "trainer-config.json", 1, run_command.trainer_env(has_gpus=False), workdir / "termination-log"
    )
    assert code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "ChildFailedError" not in err, err
    lines = err.strip().splitlines()
    assert lines[-1].startswith("memfit run: error: ") and "plan is for 2" in lines[-1], err
    assert "an earlier run" not in err


# --- the launch check: what the trainer would refuse at start-up, said before torchrun starts any rank ---

CHECKING = "memfit: checking the model, the tokenizer and the data as 2 rank(s) will load them"


def refusal(capsys: pytest.CaptureFixture[str]) -> str:
    """The one error line of a run refused by the launch check (after the line saying it checks)."""
    checking, line = capsys.readouterr().err.strip().splitlines()
    assert checking == CHECKING
    assert line.startswith("memfit run: error: ")
    return line.removeprefix("memfit run: error: ")


def refused_before_torchrun(job: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> str:
    """``memfit run JOB --local`` on 2 ranks refused by the launch check (torchrun never started): its line."""
    monkeypatch.setattr(run_command, "_torchrun", no_torchrun)
    assert main(["run", str(job), "--local", "--nproc", "2"]) == 2
    return refusal(capsys)


@pytest.mark.slow
def test_a_tiny_job_passes_the_launch_check(tiny_job: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", str(tiny_job), "--local", "--nproc", "2", "--dry-run"]) == 0
    assert capsys.readouterr().err.strip() == CHECKING  # nothing else: the check's own output is dropped
    assert [p.name for p in (tiny_job.parent / "output" / "tiny" / ".memfit").iterdir()] == ["trainer-config.json"]


@pytest.mark.slow
def test_a_dataset_too_small_for_a_micro_batch_per_rank_is_refused_before_torchrun(
    tiny_job: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tiny_job.parent / "data" / "train.jsonl"
    data.write_text("".join(data.read_text().splitlines(keepends=True)[:3]))
    line = refused_before_torchrun(tiny_job, monkeypatch, capsys)
    assert line.startswith(f"dataset {str(data)!r} is too small: one micro-batch on each of 2 rank(s)"), line


@pytest.mark.slow
def test_a_validation_split_too_small_for_a_micro_batch_per_rank_is_refused_before_torchrun(
    tiny_job: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    text = tiny_job.read_text()
    assert "    textField: text\n" in text
    tiny_job.write_text(
        text.replace("    textField: text\n", "    textField: text\n    validation: {fraction: 0.005}\n")
    )
    line = refused_before_torchrun(
        tiny_job, monkeypatch, capsys
    )  # 2 of the 400 records held out: 3 blocks of 128 tokens, not 2 x 4
    data = tiny_job.parent / "data" / "train.jsonl"
    assert line.startswith(f"the validation data (validation.fraction 0.005 of {str(data)!r}): "), line
    assert "is too small: one micro-batch on each of 2 rank(s)" in line


@pytest.mark.slow
def test_a_model_directory_without_a_tokenizer_is_refused_before_torchrun(
    claimed_model_job: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = model_dir(claimed_model_job, TINY_SHAPE)  # config.json of the planned shape, no tokenizer
    line = refused_before_torchrun(claimed_model_job, monkeypatch, capsys)
    assert line.startswith(f"cannot load tokenizer: the directory {str(directory.resolve())!r} has no loadable"), line


@pytest.mark.slow
def test_a_hub_model_offline_fails_fast_naming_it(
    tiny_job: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    text = tiny_job.read_text()
    assert "    name: tiny-llama\n    randomInit: true\n" in text
    hub = "    name: memfit-test/no-such-model\n    source: {hub: memfit-test/no-such-model}\n"
    tiny_job.write_text(text.replace("    name: tiny-llama\n    randomInit: true\n", hub))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # memfit run --local sets it
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty Hub cache
    assert main(["run", str(tiny_job), "--local", "--nproc", "2", "--dry-run"]) == 2
    line = refusal(capsys)
    assert line.startswith("cannot load tokenizer: 'memfit-test/no-such-model' is not a local path and is not in "
                           "the local hub cache (offline mode)"), line  # fmt: skip


def test_a_launch_check_that_crashes_is_said_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    crashing = tmp_path / "python"
    crashing.write_text("#!/bin/sh\necho 'memfit-train: not this' >&2\necho 'Traceback (most recent call last):' >&2\n"
                        "echo 'RuntimeError: a bug' >&2\nexit 1\n")  # fmt: skip
    crashing.chmod(0o755)
    monkeypatch.setattr(run_command.sys, "executable", str(crashing))
    assert launch_check(tmp_path / "trainer-config.json", {}) == (
        3,
        "the trainer's launch check failed (exit 1): RuntimeError: a bug",
    )


@pytest.mark.parametrize(
    ("batch", "micro", "reason"),
    [
        (6, None, "globalBatchSize 6 does not divide over 4"),
        (8, 4, "strategy.microBatchSize 4 does not divide the 2 rows per rank of 4"),
        (8, None, "it is the fastest plan that fits here (`memfit plan` lists the others)"),
    ],
)
def test_fewer_ranks_than_offered_says_the_true_reason(batch: int, micro: int | None, reason: str) -> None:
    from memfit.cli.run_command import fewer_ranks
    from memfit.planner.search import plan_job
    from tests.planning_fixtures import ONE_A100, job

    spec = job("qwen2.5-0.5b", "full", batch=batch, strategy={"microBatchSize": micro} if micro else {})
    chosen = plan_job(spec, [ONE_A100]).chosen
    assert chosen is not None and chosen.strategy.gpus == 1
    assert fewer_ranks(spec, chosen, 4) == f"the plan uses 1 of 4 ranks: {reason}"
