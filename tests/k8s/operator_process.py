"""``memfit operator`` as a real process against the envtest API server, under the ServiceAccount identity
bound to the shipped ClusterRole (tests/k8s/cluster.py), with its log kept for failure messages."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Mapping
from pathlib import Path

from tests.k8s.cluster import wait_for


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class OperatorProcess:
    def __init__(
        self,
        kubeconfig: Path,
        log: Path,
        namespace: str | None,
        trainer_metrics_port: int,
        *extra: str,
        env: Mapping[str, str] | None = None,
    ) -> None:
        """``namespace`` None: the whole cluster; ``extra``: more `memfit operator` flags; ``env``: more
        MEMFIT_* settings (as the chart's Deployment sets them)."""
        self.metrics_port, self.health_port, self.log = free_port(), free_port(), log
        env = {
            **os.environ,
            "KUBECONFIG": str(kubeconfig),
            "MEMFIT_RESYNC_SECONDS": "2",
            "MEMFIT_PROGRESS_SECONDS": "1",
            "MEMFIT_TRAINER_METRICS_PORT": str(trainer_metrics_port),
            "MEMFIT_TRAINER_IMAGE": "registry.example/memfit-trainer:test",
            **(env or {}),
        }
        ports = ["--metrics-port", str(self.metrics_port), "--health-port", str(self.health_port)]
        scope = ["--namespace", namespace] if namespace else []
        command = [sys.executable, "-m", "memfit.cli.main", "operator", *scope, *ports, *extra]
        self._output = log.open("a")
        self.process = subprocess.Popen(command, env=env, stdout=self._output, stderr=subprocess.STDOUT)
        wait_for("the operator's /healthz", self.healthy, timeout=60)

    def healthy(self) -> bool:
        if self.process.poll() is not None:
            raise AssertionError(f"the operator exited with {self.process.returncode}:\n{self.tail()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}/healthz", timeout=2) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as response:
            text: str = response.read().decode()
            return text

    def tail(self, lines: int = 80) -> str:
        return "\n".join(self.log.read_text().splitlines()[-lines:])

    def kill(self) -> None:
        """SIGKILL: no cleanup, no goodbye to peers (a node failure or an OOM kill of the operator)."""
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)
        self._output.close()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._output.close()
