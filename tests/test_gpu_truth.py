"""bench/gpu_truth.py's logic, on a CPU: the no-GPU line, the matrix (valid jobs whose pins plan exactly the
case on a catalog H100), the steady tokens/s worked out of the trainer's own progress file, result formatting,
the process and port discovery, and (marked distributed) one real run of the toy case through the same
run-and-measure code path with ``device="cpu"`` (memory: the trainer's host RSS, labelled as such).

Every number fed to the formatting tests is SYNTHETIC (named so): nothing here is a GPU measurement."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry, Gauge, start_http_server

from bench import gpu_truth, gpu_truth_report
from bench.gpu_truth import (
    CASES,
    DEFAULT_PLANS,
    GIB,
    MATRIX,
    NO_GPU_LINE,
    Case,
    CaseResult,
    Measured,
    Planned,
    build_job,
    case_mismatch,
    format_table,
    job_document,
    plan_case,
    report_json,
    run_case,
    run_cases,
    select_cases,
    steady_tokens_per_second,
)
from memfit.api.gpupool import GPUPool
from memfit.api.vocabulary import Method, Offload
from memfit.cli.local_machine import LocalMachine
from memfit.contract.progress import read_progress
from memfit.contract.trainer_config import TrainerConfig
from memfit_trainer import loop as trainer_loop
from memfit_trainer import metrics as trainer_metrics
from memfit_trainer.metrics import TrainerMetrics

REPO = Path(__file__).resolve().parents[1]
CASE_NAMES = {case.name for case in CASES}
H100 = "NVIDIA-H100-80GB-HBM3"


def h100_pool(gpus: int = 1, cpu_gib: float = 1024) -> GPUPool:
    return GPUPool.model_validate({
        "metadata": {"name": "h100"},
        "spec": {"gpuProduct": H100, "gpusPerNode": gpus, "nodes": 1, "cpuMemoryGiBPerNode": cpu_gib},
    })  # fmt: skip


def gpu_machine(name: str = "NVIDIA H100 80GB HBM3", mib: int = 81559, ram_gib: int = 128) -> LocalMachine:
    """A machine as inspect_machine() would describe one (nvidia-smi's name and MiB): for planning only."""
    return LocalMachine(gpu_names=(name,), gpu_memory_mib=(mib,), memory_bytes=ram_gib * GIB, cpus=16)


# --- without a GPU -----------------------------------------------------------------------------------------


def test_without_cuda_one_line_and_exit_0(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_truth.main(["--json", "/nonexistent/never-written.json"]) == 0
    out, err = capsys.readouterr()
    assert out == NO_GPU_LINE + "\n" and err == ""


@pytest.mark.slow
def test_the_script_without_cuda() -> None:
    """As a user runs it; CUDA_VISIBLE_DEVICES hides any GPU the test machine has."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "bench/gpu_truth.py"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert (done.returncode, done.stdout, done.stderr) == (0, NO_GPU_LINE + "\n", "")


def test_list_and_filter(capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu_truth.main(["--list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in listed] == [case.name for case in CASES]
    assert gpu_truth.main(["--list", "--cases", "default"]) == 0
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()] == [c.name for c in DEFAULT_PLANS]
    assert gpu_truth.main(["--list", "--cases", "llama-3.1-8b-*lora*,toy"]) == 0
    names = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert names[0].startswith("toy-") and all(n.startswith("llama-3.1-8b-") for n in names[1:])
    adapters = [c for c in MATRIX if c.model == "llama-3.1-8b" and c.method in (Method.LORA, Method.QLORA)]
    assert {n.split("-")[3] for n in names[1:]} == {"lora", "qlora"} and len(names) == 1 + len(adapters)
    assert gpu_truth.main(["--list", "--cases", "no-such-model"]) == 2
    assert "no case matches" in capsys.readouterr().err


def test_bad_step_counts_are_refused(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # refused before anything would run
    assert gpu_truth.main(["--steps", "21"]) == 2
    assert gpu_truth.main(["--steps", "5", "--warmup", "5"]) == 2
    assert "--warmup" in capsys.readouterr().err


def test_constants_match_the_trainer() -> None:
    assert gpu_truth.HOLD_ENV == trainer_loop.HOLD_ENV
    assert gpu_truth.RATE_WINDOW_STEPS == trainer_metrics.RATE_WINDOW_STEPS


# --- the matrix --------------------------------------------------------------------------------------------


def test_matrix_covers_every_method_and_technique() -> None:
    names = [case.name for case in MATRIX]
    assert len(set(names)) == len(names)
    assert {case.method for case in MATRIX} == {Method.FULL, Method.LORA, Method.QLORA}
    assert {case.zero_stage for case in MATRIX} == {0, 1, 2, 3}
    assert any(case.offload_optimizer == Offload.CPU for case in MATRIX)
    assert any(case.offload_parameters == Offload.CPU for case in MATRIX)
    assert {case.gradient_checkpointing for case in MATRIX} == {False, True}
    assert any(case.accumulation > 1 for case in MATRIX)
    assert {"qwen2.5-0.5b", "llama-3.1-8b"} <= {case.model for case in MATRIX}


@pytest.mark.parametrize("case", MATRIX, ids=lambda case: case.name)
def test_every_case_is_a_valid_job(case: Case) -> None:
    job = build_job(case, ranks=2, steps=6)
    spec = job.spec
    assert spec.model.random_init and spec.method == case.method
    assert spec.training.max_steps == 6 and spec.training.checkpoint_every_steps == 6
    assert spec.training.global_batch_size == case.micro_batch_size * case.accumulation * 2
    pinned = spec.strategy
    assert (pinned.zero_stage, pinned.offload_optimizer, pinned.offload_parameters) == (
        case.zero_stage, case.offload_optimizer, case.offload_parameters,
    )  # fmt: skip
    assert (pinned.gradient_checkpointing, pinned.micro_batch_size, pinned.attention) == (
        case.gradient_checkpointing, case.micro_batch_size, case.attention,
    )  # fmt: skip
    assert json.loads(json.dumps(job_document(case)))  # plain data, written as the job's YAML


@pytest.mark.parametrize("gpus", [1, 2])
@pytest.mark.parametrize("case", MATRIX, ids=lambda case: case.name)
def test_pins_plan_exactly_the_case_on_an_h100(case: Case, gpus: int) -> None:
    result = plan_case(build_job(case, ranks=gpus), h100_pool(gpus), gpus)
    assert result.chosen is not None, gpu_truth.why_not(result)
    assert case_mismatch(case, result.chosen.strategy, gpus) is None, result.chosen.strategy.summary()
    assert result.chosen.memory.per_gpu.peak_allocated_bytes > 0


@pytest.mark.parametrize("case", DEFAULT_PLANS, ids=lambda case: case.name)
def test_a_default_plan_pins_nothing_and_runs_what_the_planner_chooses(case: Case) -> None:
    spec = job_document(case, ranks=2)["spec"]
    assert "strategy" not in spec and spec["training"].keys() == {
        "globalBatchSize", "sequenceLength", "maxSteps", "checkpointEverySteps",
    }  # fmt: skip
    assert spec["training"]["globalBatchSize"] == 2 * case.micro_batch_size
    for gpus in (1, 2):
        result = plan_case(build_job(case, ranks=gpus), h100_pool(gpus), gpus)
        assert result.chosen is not None, gpu_truth.why_not(result)
        assert case_mismatch(case, result.chosen.strategy, gpus) is None  # whatever it chose
        assert case_mismatch(case, result.chosen.strategy, gpus + 1) == f"GPUs {gpus} (case: {gpus + 1})"
        assert Planned.of(result.chosen).attention == str(result.chosen.strategy.attention)


def test_a_mismatch_is_named() -> None:
    case = next(c for c in MATRIX if c.method == Method.LORA and c.gradient_checkpointing)
    result = plan_case(build_job(case), h100_pool(), 1)
    assert result.chosen is not None
    other = result.chosen.strategy
    assert case_mismatch(case, other, 2) == "GPUs 1 (case: 2)"
    assert "gradient checkpointing True" in str(case_mismatch(Case("toy", Method.LORA, 1, 2048), other, 1))


def test_cases_that_do_not_fit_are_skipped_with_the_planners_reason(tmp_path: Path) -> None:
    """Nothing is measured: the row says why (the skip comes before the run; run=False keeps a wrong
    expectation here from starting one)."""

    def skip(case: Case, machine: LocalMachine, ranks: int = 1) -> CaseResult:
        return run_case(case, machine=machine, device="cuda", ranks=ranks, steps=8, warmup=3, timeout=60,
                        root=tmp_path, run=False)  # fmt: skip

    three_b_full = next(c for c in MATRIX if c.model == "llama-3.2-3b" and c.method == Method.FULL)
    on_an_l4 = skip(three_b_full, gpu_machine("NVIDIA L4", 23034))
    assert on_an_l4.status == "skipped" and on_an_l4.measured is None and on_an_l4.planned is None
    assert on_an_l4.reason is not None and on_an_l4.reason.startswith("does not fit: GPU memory: needs")
    zero3 = next(c for c in MATRIX if c.offload_parameters == Offload.CPU)
    little_ram = skip(zero3, gpu_machine(ram_gib=64))
    assert little_ram.status == "skipped" and little_ram.reason is not None and "CPU memory" in little_ram.reason
    too_many = skip(MATRIX[1], gpu_machine(), ranks=2)
    assert too_many.status == "skipped" and "this machine has 1 GPU" in str(too_many.reason)
    assert list(tmp_path.iterdir()) == []


def test_plan_only_runs_nothing(tmp_path: Path) -> None:
    results = run_cases(select_cases(["qwen2.5-0.5b"]), run=False, machine=gpu_machine(), keep=tmp_path)
    assert results and all(r.status == "not run" and r.planned is not None and r.measured is None for r in results)
    assert all(r.memory_ratio is None and r.throughput_ratio is None for r in results)
    assert all(not any(run.iterdir()) for run in tmp_path.iterdir())  # no job was even written


def test_no_case_starts_once_the_budget_is_spent(tmp_path: Path) -> None:
    cases = select_cases(["qwen2.5-0.5b"])
    results = run_cases(cases, run=False, machine=gpu_machine(), keep=tmp_path, budget=-1.0)
    assert [r.case for r in results] == cases
    assert all(r.status == "not run" and "--budget" in (r.reason or "") and r.planned is None for r in results)


def test_cpu_device_refuses_a_gpu_machine_and_cuda_a_cpu_one() -> None:
    with pytest.raises(ValueError, match="without GPUs"):
        run_cases(MATRIX[:1], device="cpu", run=False, machine=gpu_machine())
    cpu = LocalMachine(gpu_names=(), gpu_memory_mib=(), memory_bytes=8 * GIB, cpus=2)
    with pytest.raises(ValueError, match="no GPU"):
        run_cases(MATRIX[:1], device="cuda", run=False, machine=cpu)


# --- steady tokens/s from the trainer's own progress file --------------------------------------------------


def metrics_config(progress_file: Path) -> TrainerConfig:
    return TrainerConfig.model_validate({
        "job": "gpu-truth/formula",
        "model": {"nameOrPath": "toy", "randomInit": True, "architecture": gpu_truth.TOY_ARCHITECTURE},
        "data": {"path": "/data/train.jsonl"},
        "training": {"method": "full", "sequenceLength": 128, "microBatchSize": 4, "gradientAccumulationSteps": 1,
                     "globalBatchSize": 8, "maxSteps": 8, "learningRate": 1e-3, "precision": "bf16",
                     "checkpointEverySteps": 8},
        "outputDir": "/output",
        "engine": {"kind": "deepspeed", "config": {}},
        "metrics": {"port": 0, "progressFile": str(progress_file)},
    })  # fmt: skip


@pytest.fixture
def rank0(tmp_path: Path) -> Iterator[TrainerMetrics]:
    metrics = TrainerMetrics(metrics_config(tmp_path / "progress.json"), rank=0, world_size=2, port=0,
                             device=torch.device("cpu"))  # fmt: skip
    yield metrics
    metrics.close()


@pytest.mark.parametrize("warmup", [1, 3, 7])
@pytest.mark.slow
def test_steady_rate_from_the_trainers_progress_file(tmp_path: Path, rank0: TrainerMetrics, warmup: int) -> None:
    """SYNTHETIC step times fed to the trainer's real TrainerMetrics: the progress file read after the warm-up
    step and after the last gives exactly the rate of the steps in between."""
    steps, tokens = 8, 4 * 128
    synthetic_seconds = [9.0, 2.5, 1.25, 0.5, 0.75, 0.5, 0.625, 0.5]  # slow first steps, as on a GPU
    read: dict[int, float] = {}
    for step, seconds in enumerate(synthetic_seconds, start=1):
        rank0.step(step=step, total_steps=steps, loss=1.0, learning_rate=1e-3, tokens=tokens, samples=4,
                   step_seconds=seconds)  # fmt: skip
        progress = read_progress(tmp_path / "progress.json")
        assert progress is not None and progress.step == step
        read[step] = progress.tokens_per_second
    expected = (steps - warmup) * tokens * 2 / sum(synthetic_seconds[warmup:])  # 2 ranks
    assert steady_tokens_per_second(warmup, read[warmup], steps, read[steps]) == pytest.approx(expected, rel=1e-9)


def test_steady_rate_refuses_what_it_cannot_work_out() -> None:
    with pytest.raises(ValueError, match="steps"):
        steady_tokens_per_second(3, 100.0, 21, 100.0)  # beyond the trainer's window
    with pytest.raises(ValueError, match="steps"):
        steady_tokens_per_second(0, 100.0, 8, 100.0)
    with pytest.raises(ValueError, match="not positive"):
        steady_tokens_per_second(3, 0.0, 8, 100.0)
    with pytest.raises(ValueError, match="inconsistent"):
        steady_tokens_per_second(3, 100.0, 8, 1000.0)


# --- results, table and JSON (SYNTHETIC numbers) -----------------------------------------------------------

SYNTHETIC_PLANNED = Planned(strategy="full zero0 mb4x1 bf16 adamw on 1x1 local", attention="sdpa",
                            peak_allocated_bytes=20 * GIB, total_bytes=22 * GIB, gpu_memory_bytes=80 * GIB,
                            tokens_per_second=10_000.0)  # fmt: skip


def synthetic_results() -> list[CaseResult]:
    measured = Measured("cuda", peak_bytes=21 * GIB, peak_through_step=8, peak_per_rank={0: 21 * GIB},
                        tokens_per_second=8_000.0, steady_steps=(4, 8))  # fmt: skip
    return [
        CaseResult(MATRIX[1], "measured", None, SYNTHETIC_PLANNED, measured, seconds=42.0),
        CaseResult(MATRIX[2], "skipped", "does not fit: GPU memory: needs 90.0 GiB per GPU"),
        CaseResult(MATRIX[3], "not run", "--plan-only", SYNTHETIC_PLANNED),
        CaseResult(MATRIX[4], "failed", "exit code 1: boom", SYNTHETIC_PLANNED, Measured("cuda"), seconds=3.0),
        CaseResult(
            MATRIX[5],
            "out of memory",
            "CUDA out of memory in step 1",
            SYNTHETIC_PLANNED,
            Measured("cuda", peak_bytes=79 * GIB),
            seconds=9.0,
        ),  # fmt: skip
    ]


def test_ratios_only_where_both_sides_exist() -> None:
    measured, skipped, not_run, failed, oom = synthetic_results()
    assert measured.memory_ratio == pytest.approx(21 / 20) and measured.throughput_ratio == pytest.approx(0.8)
    for result in (skipped, not_run, failed):
        assert result.memory_ratio is None and result.throughput_ratio is None
    assert oom.memory_ratio == pytest.approx(79 / 20) and oom.throughput_ratio is None


def test_table_shows_what_was_measured_and_why_the_rest_was_not() -> None:
    lines = format_table(synthetic_results()).splitlines()
    header, rows = lines[0].split(), {line.split()[0]: line for line in lines[2:7]}
    assert header[:3] == ["case", "planned", "GiB"] and header[-1] == "status"
    measured = rows[MATRIX[1].name].split()
    assert measured[1:9] == ["20.00", "21.00", "@8", "1.050", "10,000", "8,000", "0.800", "measured"]
    skipped = rows[MATRIX[2].name].split()
    assert skipped[1:7] == ["-"] * 6 and " skipped: does not fit: GPU memory" in rows[MATRIX[2].name]
    not_run = rows[MATRIX[3].name].split()
    assert not_run[1:7] == ["20.00", "-", "-", "10,000", "-", "-"] and "not run: --plan-only" in rows[MATRIX[3].name]
    failed = rows[MATRIX[4].name].split()
    assert failed[2:4] == ["-", "-"] and failed[5:7] == ["-", "-"] and "failed: exit code 1" in rows[MATRIX[4].name]
    assert rows[MATRIX[5].name].split()[2:4] == ["79.00", "@OOM"]
    assert "max_memory_allocated" in "\n".join(lines[7:])


def test_json_report() -> None:
    info = {"date": "SYNTHETIC", "gpu": "1x SYNTHETIC GPU"}
    document = json.loads(json.dumps(report_json(info, {"steps": 8}, synthetic_results())))
    assert document["header"] == info and document["settings"] == {"steps": 8}
    measured, skipped, not_run, failed, oom = document["results"]
    assert measured["name"] == MATRIX[1].name and measured["status"] == "measured"
    assert measured["planned"]["peakAllocatedBytes"] == 20 * GIB
    assert measured["measured"]["peakBytes"] == 21 * GIB and measured["measured"]["steadySteps"] == [4, 8]
    assert "max_memory_allocated" in measured["measured"]["memorySource"]
    assert measured["ratios"] == {"peakMemory": pytest.approx(1.05), "tokensPerSecond": pytest.approx(0.8)}
    assert skipped["planned"] is None and skipped["measured"] is None and skipped["reason"].startswith("does not")
    assert not_run["measured"] is None and not_run["ratios"] == {"peakMemory": None, "tokensPerSecond": None}
    assert failed["measured"] is None  # nothing was read from that run: no zeros stand in for it
    assert oom["measured"]["peakBytes"] == 79 * GIB and oom["measured"]["tokensPerSecond"] is None
    assert measured["case"]["method"] == "full" and measured["case"]["sequenceLength"] == MATRIX[1].sequence_length


def test_a_gpu_run_writes_a_dated_file_and_the_readme_shows_the_newest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gpu_truth, "RESULTS_DIR", tmp_path / "results")
    first = gpu_truth.dated_results_path("2026-12-01T10:00:00Z")
    assert first == tmp_path / "results" / "gpu-truth-2026-12-01.json"
    info = {"date": "2026-12-01T10:00:00Z", "gpu": "1x SYNTHETIC GPU", "transformers": "9.9"}
    first.write_text(json.dumps(report_json(info, {"gpus": 1, "steps": 8, "warmup": 3}, synthetic_results())))
    second = gpu_truth.dated_results_path("2026-12-01T18:00:00Z")
    assert second.name == "gpu-truth-2026-12-01-2.json"  # a second run that day keeps the first
    second.write_text(first.read_text())
    (tmp_path / "results" / "gpu-truth-2026-11-30.json").write_text("{}")
    assert gpu_truth_report.newest(tmp_path / "results") == second
    text = gpu_truth_report.report(json.loads(second.read_text()))
    lines = text.splitlines()
    assert lines[0].startswith("2026-12-01: 1x SYNTHETIC GPU") and "transformers 9.9" in lines[0]
    rows = {line.split()[0]: line.split() for line in lines if line.split() and line.split()[0] in CASE_NAMES}
    assert list(rows) == [MATRIX[1].name, MATRIX[5].name]  # what ran: measured, out of memory
    assert rows[MATRIX[1].name][-6:] == ["20.00", "21.00", "1.050", "10,000", "8,000", "0.800"]
    assert rows[MATRIX[5].name][-7:-3] == ["20.00", "79.00", "@OOM", "3.950"]
    assert lines[-1] == "not measured in this run: 1 failed, 1 not run, 1 skipped (of 5 cases)"


def test_the_report_without_a_results_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(gpu_truth_report, "RESULTS_DIR", tmp_path)
    assert gpu_truth_report.main([]) == 2 and "no results file" in capsys.readouterr().err
    (tmp_path / "broken.json").write_text("{")
    assert gpu_truth_report.main([str(tmp_path / "broken.json")]) == 2
    assert "broken.json" in capsys.readouterr().err


def test_the_header_names_the_trainers_package_versions() -> None:
    import transformers

    versions = gpu_truth.package_versions()
    assert tuple(versions) == gpu_truth.MEASURED_PACKAGES and versions["transformers"] == transformers.__version__


def test_cpu_memory_is_labelled_as_host_rss() -> None:
    result = CaseResult(MATRIX[0], "measured", None, SYNTHETIC_PLANNED, Measured("cpu", peak_bytes=GIB))
    assert "NOT GPU memory" in format_table([result], "cpu")
    assert "host RSS" in result.to_dict()["measured"]["memorySource"]


# --- processes, ports, the trainer's termination message ---------------------------------------------------


@pytest.fixture
def fake_ranks() -> Iterator[dict[str, subprocess.Popen[bytes]]]:
    """Sleeping children whose command lines and environments look like torchrun's agent and two workers."""
    sleep = [sys.executable, "-c", "import time; time.sleep(120)"]
    started = {
        "agent": subprocess.Popen([*sleep, "--nproc-per-node=2", "-m", "memfit_trainer.main"],
                                  env={**os.environ, "RANK": "0", "LOCAL_RANK": "0"}),
        "rank0": subprocess.Popen([*sleep, "-m", "memfit_trainer.main"], env={**os.environ, "RANK": "0",
                                                                            "LOCAL_RANK": "0"}),
        "rank1": subprocess.Popen([*sleep, "-m", "memfit_trainer.main"], env={**os.environ, "RANK": "1",
                                                                            "LOCAL_RANK": "1"}),
        "other": subprocess.Popen(sleep, env={**os.environ, "RANK": "2", "LOCAL_RANK": "0"}),
    }  # fmt: skip
    yield started
    for process in started.values():
        process.kill()
        process.wait()


def test_trainer_ranks_are_found_below_the_run(fake_ranks: dict[str, subprocess.Popen[bytes]]) -> None:
    found = gpu_truth.trainer_ranks(os.getpid())
    assert found == {0: fake_ranks["rank0"].pid, 1: fake_ranks["rank1"].pid}
    assert gpu_truth.trainer_ranks(fake_ranks["rank0"].pid) == {}


@pytest.mark.slow
def test_the_metrics_port_is_found_among_the_listening_sockets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu_truth, "SCRAPE_TIMEOUT_SECONDS", 0.5)

    with socket.socket() as silent:  # listens, never answers (as another library's socket would)
        silent.bind(("0.0.0.0", 0))
        silent.listen()
        registry = CollectorRegistry()
        Gauge("memfit_train_step", "SYNTHETIC", registry=registry).set(3)
        Gauge("memfit_host_memory_bytes", "SYNTHETIC", ["device"], registry=registry).labels("cpu").set(5)
        server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
        try:
            ports = gpu_truth.listening_ports(os.getpid())
            assert silent.getsockname()[1] in ports and server.server_port in ports
            assert ports.index(silent.getsockname()[1]) < ports.index(server.server_port)  # wildcard first
            assert gpu_truth.find_metrics_port(os.getpid()) == server.server_port
            values = gpu_truth.metric_values(gpu_truth.scrape(server.server_port))
            assert values["memfit_train_step"] == 3 and values["memfit_host_memory_bytes"] == 5
        finally:
            server.shutdown()
            server.server_close()
            thread.join()


def test_an_out_of_memory_exit_reports_the_trainers_measured_peak(tmp_path: Path) -> None:
    """The termination message here is SYNTHETIC, written before a stand-in process that exits at once."""
    (tmp_path / "work").mkdir()
    message = {"reason": "OutOfMemory", "step": 2, "plannedPeakBytes": 10 * GIB, "measuredPeakBytes": 12 * GIB}
    (tmp_path / "work" / "termination-log").write_text(json.dumps(message))
    run = gpu_truth._Run([sys.executable, "-c", "raise SystemExit(1)"], dict(os.environ), tmp_path, "cuda", 1)
    with pytest.raises(gpu_truth._RunFailed) as failure:
        run.wait_for_step(3, time.monotonic() + 60)
    assert (failure.value.status, failure.value.reason) == ("out of memory", "CUDA out of memory in step 2")
    assert run.measured.peak_bytes == 12 * GIB and run.measured.tokens_per_second is None
    run.stop()


def test_a_run_that_ends_early_reports_its_exit_and_last_output(tmp_path: Path) -> None:
    command = [sys.executable, "-c", "print('memfit run: error: something refused'); raise SystemExit(2)"]
    run = gpu_truth._Run(command, dict(os.environ), tmp_path, "cuda", 1)
    with pytest.raises(gpu_truth._RunFailed) as failure:
        run.wait_for_step(3, time.monotonic() + 60)
    assert failure.value.status == "failed"
    assert failure.value.reason == "exit code 2: memfit run: error: something refused"
    assert not run.measured.anything


# --- one real run on the CPU -------------------------------------------------------------------------------


@pytest.mark.distributed
def test_the_toy_case_runs_and_is_measured_on_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``memfit run --local`` under torchrun (1 CPU rank), held after the warm-up, scraped, stopped: the same
    code path as on a GPU, with the trainer's host RSS in place of GPU memory (and labelled so)."""
    if gpu_truth.inspect_machine().has_gpus:
        pytest.skip("device='cpu' is for machines without GPUs; on a GPU machine run bench/gpu_truth.py itself")
    default = os.environ.get("TORCH_EXTENSIONS_DIR") or str(Path.home() / ".cache" / "torch_extensions")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", default)  # DeepSpeed's CPU ops, built once (as tests/trainer)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    toy = select_cases(["toy"])
    assert len(toy) == 1
    # 15-30 s once DeepSpeed's CPU ops are built; the time limit leaves room for building them first.
    [result] = run_cases(toy, device="cpu", ranks=1, steps=6, warmup=2, timeout=600, keep=tmp_path)
    assert result.status == "measured", result.reason
    assert result.planned is not None and result.measured is not None
    measured = result.measured
    assert measured.peak_bytes is not None and measured.peak_bytes > 100 * 2**20  # a torch process's RSS
    assert measured.peak_through_step is not None and 2 <= measured.peak_through_step <= 6
    assert measured.tokens_per_second is not None and measured.tokens_per_second > 0
    assert measured.steady_steps == (3, 6)
    assert result.memory_ratio is not None and result.throughput_ratio is not None
    assert "host RSS" in result.to_dict()["measured"]["memorySource"]
    [run_dir] = [path for path in tmp_path.iterdir()]
    case_dir = run_dir / gpu_truth.job_name(toy[0])
    progress = read_progress(case_dir / "work" / "progress.json")
    assert progress is not None and progress.step == 6
    left = [pid for pid in os.listdir("/proc") if pid.isdigit() and _cmdline_mentions(int(pid), str(case_dir))]
    assert left == [], "trainer processes outlived the run"


def _cmdline_mentions(pid: int, text: str) -> bool:
    try:
        return text.encode() in Path(f"/proc/{pid}/cmdline").read_bytes() and gpu_truth._running(pid)
    except OSError:
        return False
