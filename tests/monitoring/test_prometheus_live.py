"""A real Prometheus on loopback scrapes a real local training run, a GPU-shaped trainer endpoint and the
operator's metrics, loads the chart's rules, and answers every query of the dashboards and every rule.

Targets:
* the tiny example as `memfit run --local` plans and renders it (two CPU ranks under torchrun), served on a
  fixed port instead of an ephemeral one, with a validation split, and with far more steps than the test
  needs: the run lasts until the test stops it, however fast the machine trains;
* the trainer's own ``TrainerMetrics`` for a job on a "GPU": this machine has none, so PyTorch's CUDA
  allocator readings are stubbed; names, labels and the plan's predictions (with the GPU's peak FLOP/s,
  hence MFU) are the real code's. The GPU memory panels and the memory alerts need this target;
* `memfit operator` itself, following a small fleet on a real kube-apiserver (tests/k8s): the tiny job
  (running after one out-of-memory re-plan; the operator reads its progress from the real rank 0), the
  GPU job (running), a failed one and an unschedulable one; the test plays the kubelet.

Every dashboard query for the tiny job (the GPU-only ones for the GPU job), every recording rule and every
alert's signal (its expression without the threshold) must return data; whole alert expressions must be
accepted; Prometheus must report every rule healthy.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import torch
from kubernetes import client, config

from memfit.contract.progress import read_progress
from memfit.contract.sections import MetricsConfig, PredictionConfig, ValidationConfig
from memfit.contract.trainer_config import TrainerConfig
from memfit_trainer.metrics import TrainerMetrics
from tests.chart.render import ROOT, rule_groups
from tests.k8s.apiserver import running_apiserver
from tests.k8s.cluster import (
    GROUP,
    VERSION,
    Kubelet,
    create_namespace,
    example,
    grant_operator_role,
    install_crds,
    wait_for,
)
from tests.k8s.operator_process import OperatorProcess
from tests.monitoring.expressions import dashboard_queries, dump, metric_names, rules, signal, tool, with_variables
from tests.trainer.runs import torchrun_command, trainer_env

pytestmark = [pytest.mark.k8s, pytest.mark.distributed]
CPU_JOB, GPU_JOB = "default/tiny", "default/gpu-job"
GPU_ONLY = {
    "memfit_gpu_memory_peak_allocated_bytes",
    "memfit_gpu_memory_reserved_bytes",
    "finetunejob_rank:memfit_gpu_memory_peak_allocated_bytes:max",
    "memfit_train_estimated_mfu_ratio",
}
"""Series a CPU run does not have: measured GPU memory, and MFU (a local plan knows no peak FLOP/s)."""
H100_BF16_FLOPS = 989e12
ENDLESS_STEPS = 10_000_000
"""The tiny run's maxSteps here: days of training on any machine. The fixture stops the run when the tests are
done with it; nothing depends on how fast it trains."""
VALIDATION = ValidationConfig(fraction=0.1, every_steps=5)
"""Evaluated by step 5, well before the fixture's step 15."""


def free_ports(count: int) -> list[int]:
    """``count`` consecutive free loopback ports (the trainer serves rank r on base + r)."""
    for _ in range(100):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        sockets = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                sockets.append(s)
                s.bind(("127.0.0.1", port))
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
        return list(range(base, base + count))
    raise RuntimeError("no consecutive free ports")


def tiny_run_config(tmp_path: Path, port: int) -> Path:
    """`memfit run examples/tiny/job.yaml --local --dry-run`: the config a local run trains with, on a fixed
    metrics port and with ENDLESS_STEPS steps."""
    example = tmp_path / "tiny"
    shutil.copytree(ROOT / "examples" / "tiny", example, ignore=shutil.ignore_patterns("output"))
    workdir = tmp_path / "work"
    command = [sys.executable, "-m", "memfit.cli.main", "run", str(example / "job.yaml"), "--local", "--dry-run",
               "--workdir", str(workdir)]  # fmt: skip
    planned = subprocess.run(command, capture_output=True, text=True, timeout=120, env=trainer_env())
    assert planned.returncode == 0, planned.stdout + planned.stderr
    config = TrainerConfig.model_validate_json((workdir / "trainer-config.json").read_text())
    assert config.job == CPU_JOB and config.prediction is not None
    metrics = MetricsConfig(port=port, progress_file=config.metrics.progress_file)
    training = config.training.model_copy(update={"max_steps": ENDLESS_STEPS})
    data = config.data.model_copy(update={"validation": VALIDATION})  # the validation-loss panel's series
    path = workdir / "trainer-config.json"
    path.write_text(config.model_copy(update={"metrics": metrics, "training": training, "data": data}).to_json())
    return path


class GPURank:
    """The trainer's metrics endpoint of one GPU rank, fed with steps from a thread."""

    def __init__(self, config: TrainerConfig, port: int, monkeypatch: pytest.MonkeyPatch) -> None:
        for reading, value in (("memory_allocated", 30e9), ("memory_reserved", 34e9), ("max_memory_allocated", 38e9)):
            monkeypatch.setattr(torch.cuda, reading, lambda device=None, value=value: value)
        prediction = PredictionConfig(
            strategy="lora zero0 mb4x1 bf16 adamw on 1x1 h100",
            peak_allocated_bytes=36 * 10**9,
            total_bytes=40 * 10**9,
            gpu_memory_bytes=80 * 10**9,
            tokens_per_second=9000.0,
            peak_flops=H100_BF16_FLOPS,
        )
        metrics = MetricsConfig(port=port, progress_file=None)  # the tiny run's progress file is not ours
        gpu_config = config.model_copy(update={"job": GPU_JOB, "prediction": prediction, "metrics": metrics})
        self.metrics = TrainerMetrics(gpu_config, rank=0, world_size=1, port=port, device=torch.device("cuda", 0))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._train, daemon=True)
        self._thread.start()

    def _train(self) -> None:
        step = 0
        while not self._stop.wait(0.3):
            step += 1
            self.metrics.step(step=step, total_steps=10_000, loss=2.0 - step * 1e-3, learning_rate=1e-4,
                              tokens=4096, samples=2, step_seconds=0.45)  # fmt: skip
            if step % 10 == 0:
                self.metrics.checkpoint(step=step, seconds=1.5)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.metrics.close()


def job(name: str, **spec: Any) -> dict[str, Any]:
    manifest = copy.deepcopy(example("llama-3.1-8b-lora.yaml")[0])
    manifest["metadata"].update(name=name, namespace="default")
    manifest["spec"].update(spec)
    return manifest


def operator_fleet(stack: ExitStack, tmp_path: Path, trainer_port: int) -> OperatorProcess:
    """A real operator on a real API server with the jobs a fleet has (see the module docstring)."""
    server = stack.enter_context(running_apiserver())
    api = config.new_client_from_config(str(server.kubeconfig))
    install_crds(api)
    grant_operator_role(api)
    create_namespace(api, "default")
    objects, kubelet = client.CustomObjectsApi(api), Kubelet(api)
    for pool in example("inventory.yaml"):
        objects.create_cluster_custom_object(GROUP, VERSION, "gpupools", pool)
    operator = OperatorProcess(server.operator_kubeconfig, tmp_path / "operator.log", "default", trainer_port,
                               "--standalone")  # fmt: skip
    stack.callback(operator.stop)
    for manifest in (
        job("tiny"),
        job("gpu-job"),
        job("broken", maxRestarts=0),
        job("queued", resources={"pool": "none"}),
    ):
        objects.create_namespaced_custom_object(GROUP, VERSION, "default", "finetunejobs", manifest)
    core = client.CoreV1Api(api)

    def pod(name: str, attempt: int) -> str:
        selector = f"memfit.dev/job={name},memfit.dev/attempt={attempt}"
        return wait_for(
            f"{name} attempt {attempt}", lambda: core.list_namespaced_pod("default", label_selector=selector).items
        )[0].metadata.name

    oom = json.dumps(
        {"reason": "OutOfMemory", "step": 2, "measuredPeakBytes": 81 * 2**30, "plannedPeakBytes": 66 * 2**30}
    )
    kubelet.terminate("default", pod("tiny", 1), 1, message=oom)
    kubelet.run("default", pod("tiny", 2))
    kubelet.run("default", pod("gpu-job", 1))
    kubelet.terminate("default", pod("broken", 1), 1)
    return operator


class Prometheus:
    def __init__(self, tmp_path: Path, trainer_targets: list[str], operator_target: str) -> None:
        dump({"groups": rule_groups()}, tmp_path / "memfit.rules.yaml")
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": ["memfit.rules.yaml"],
            "scrape_configs": [
                {"job_name": "trainer", "static_configs": [{"targets": trainer_targets}]},
                {"job_name": "memfit-operator", "static_configs": [{"targets": [operator_target]}]},
            ],
        }
        (self.port,) = free_ports(1)
        self.process = subprocess.Popen(
            [tool("prometheus"), f"--config.file={dump(config, tmp_path / 'prometheus.yml')}",
             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}",
             "--log.level=warn"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while True:
            assert self.process.poll() is None, self.process.stderr.read() if self.process.stderr else ""
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2)
                return
            except OSError:
                assert time.monotonic() < deadline, "prometheus not ready within 60 s"
                time.sleep(0.3)

    def api(self, path: str, **params: Any) -> Any:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}?{urllib.parse.urlencode(params, doseq=True)}"
        try:
            with urllib.request.urlopen(url, timeout=30) as response:
                body = json.load(response)
        except urllib.error.HTTPError as error:
            raise AssertionError(f"{path} {params}: {error.read().decode()}") from None
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str, at: float) -> list[dict[str, Any]]:
        return self.api("query", query=expr, time=at)["result"]

    def evaluated_after(self, at: float) -> bool:
        """Whether every rule group has been evaluated since ``at`` (on data scraped up to then)."""
        groups = self.api("rules")["groups"]
        return bool(groups) and all(_timestamp(group["lastEvaluation"]) > at for group in groups)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


def _timestamp(rfc3339: str) -> float:
    """Prometheus's RFC 3339 times (nanoseconds, ``Z``) as seconds since the epoch."""
    trimmed = re.sub(r"(\.\d{6})\d+", r"\1", rfc3339).replace("Z", "+00:00")
    return datetime.fromisoformat(trimmed).timestamp()


def stop_run(run: subprocess.Popen[str]) -> None:
    """End the endless run: SIGTERM to torchrun, which passes it to its workers; SIGKILL if that is not enough."""
    run.terminate()
    try:
        run.wait(timeout=120)
    except subprocess.TimeoutExpired:
        run.kill()
        run.wait(timeout=60)


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Prometheus, float]]:
    """Everything running and scraped; yields Prometheus and a time at which every target had data."""
    tool("promtool")
    prometheus_binary = tool("prometheus")
    assert prometheus_binary
    tmp_path = tmp_path_factory.mktemp("live")
    monkeypatch = pytest.MonkeyPatch()
    rank0, rank1, gpu_port = free_ports(3)
    config_path = tiny_run_config(tmp_path, rank0)
    config = TrainerConfig.model_validate_json(config_path.read_text())
    stack = ExitStack()
    log = stack.enter_context((tmp_path / "run.log").open("w"))  # a file: an endless run never fills a pipe
    # Started first: its imports and first steps overlap the start of the API server, the operator and Prometheus
    # (nothing waits on the order: the run lasts until stopped, and the loop below waits for what it needs).
    run = subprocess.Popen(torchrun_command(config_path), env=trainer_env(), stdout=log, stderr=subprocess.STDOUT,
                           text=True)  # fmt: skip
    try:
        operator = operator_fleet(stack, tmp_path, rank0)
        prometheus = Prometheus(tmp_path, [f"127.0.0.1:{p}" for p in (rank0, rank1, gpu_port)],
                                f"127.0.0.1:{operator.metrics_port}")  # fmt: skip
        stack.callback(prometheus.stop)
        stack.callback(monkeypatch.undo)
        gpu = GPURank(config, gpu_port, monkeypatch)
        stack.callback(gpu.close)
        deadline = time.monotonic() + 600
        progress_file = Path(config.metrics.progress_file or "")
        while True:
            assert run.poll() is None, "the endless run failed:\n" + (tmp_path / "run.log").read_text()[-5000:]
            assert time.monotonic() < deadline, "the tiny run made too little progress in 10 minutes"
            progress = read_progress(progress_file)
            if progress is not None and progress.step >= 15:
                samples = prometheus.query("min(count_over_time(memfit_train_step[1m]))", time.time())
                if samples and float(samples[0]["value"][1]) >= 10:  # every rank scraped 10 times mid-run
                    break
            time.sleep(0.5)
        at = time.time()
        while not prometheus.evaluated_after(at):  # the rules see everything scraped up to `at`
            assert time.monotonic() < deadline, "the rules were not evaluated within 10 minutes"
            time.sleep(0.5)
        yield prometheus, at
    finally:
        stop_run(run)  # the tests are done with it; tests/trainer checks that runs finish
        stack.close()  # the GPU rank, the stubs, Prometheus, the operator and the API server, in that order


def test_every_dashboard_query_returns_data(scraped: tuple[Prometheus, float]) -> None:
    prometheus, at = scraped
    empty = []
    for where, expr in dashboard_queries():
        job = GPU_JOB if metric_names(expr) & GPU_ONLY else CPU_JOB
        if not prometheus.query(with_variables(expr, job), at):
            empty.append(f"{where} ({job}): {expr}")
    assert not empty, "queries without data:\n" + "\n".join(empty)


def test_job_variable_lists_the_running_jobs(scraped: tuple[Prometheus, float]) -> None:
    prometheus, at = scraped
    values = prometheus.api("label/finetunejob/values", **{"match[]": "memfit_train_step", "end": at})
    assert {CPU_JOB, GPU_JOB} <= set(values)


def test_every_rule_evaluates_on_real_data(scraped: tuple[Prometheus, float]) -> None:
    prometheus, at = scraped
    empty = []
    for rule in rules():
        name = rule.get("alert") or rule["record"]
        prometheus.query(rule["expr"], at)  # the whole expression is valid for Prometheus
        measured = signal(rule["expr"]) if "alert" in rule else rule["expr"]
        if not prometheus.query(measured, at):
            empty.append(f"{name}: {measured}")
    assert not empty, "rules whose inputs have no data:\n" + "\n".join(empty)
    loaded = [r for group in prometheus.api("rules")["groups"] for r in group["rules"]]
    assert len(loaded) == len(rules()) and all(r["health"] == "ok" for r in loaded), loaded


def test_memory_alerts_see_the_gpu_rank(scraped: tuple[Prometheus, float]) -> None:
    """38 GB peak on an 80 GB GPU against a 36 GB prediction: near neither threshold, so no alert fires, but
    the ratios the alerts compare are the ones the stubbed allocator implies."""
    prometheus, at = scraped
    alerts = {rule["alert"]: rule["expr"] for rule in rules() if "alert" in rule}
    (capacity,) = prometheus.query(signal(alerts["MemfitGPUMemoryNearCapacity"]), at)
    (prediction,) = prometheus.query(signal(alerts["MemfitGPUMemoryAbovePrediction"]), at)
    assert capacity["metric"] == {"finetunejob": GPU_JOB, "rank": "0"}
    assert float(capacity["value"][1]) == pytest.approx(38 / 80)
    assert float(prediction["value"][1]) == pytest.approx(38 / 36)
    firing = prometheus.api("alerts")["alerts"]
    assert not [a for a in firing if a["labels"]["alertname"].startswith("MemfitGPUMemory")]
