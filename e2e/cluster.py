"""The real node of ``hack/node`` as the end-to-end tests drive it: kubectl, applying objects,
waiting, and the claims a job's pods mount (static hostPath PersistentVolumes: a one-node cluster has no
provisioner)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import socketserver
import subprocess
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import yaml

from tests.k8s.cluster import wait_for as cluster_wait_for

REPO = Path(__file__).resolve().parents[1]
CACHE_HOME = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
NODE_DIR = Path(os.environ.get("NODE_DIR") or CACHE_HOME / "k8s-node")
"""Where ``hack/node`` keeps its binaries and run state (its own default)."""
KUBECONFIG = NODE_DIR / "run" / "admin.kubeconfig"
POLL_SECONDS = 2.0
BRIDGE_ADDRESS = os.environ.get("POD_CIDR", "10.244.0.0/24").rsplit(".", 1)[0] + ".1"
"""The pod bridge's address on this machine (the node script's POD_GW), where pods reach the host."""
API_PORT = int(os.environ.get("API_PORT", "16443"))
"""The node's API server port (its loopback address only)."""
E2E_LABEL = "memfit.dev/e2e"
"""On the cluster-scoped objects the tests make (volumes), so the next run finds and removes them."""
T = TypeVar("T")


def kubectl_binary() -> str:
    return shutil.which("kubectl") or str(NODE_DIR / "bin" / "kubectl")


def kubectl(*args: str, stdin: str | None = None, check: bool = True) -> str:
    """kubectl against the node, its stdout; a failure raises with kubectl's own message."""
    done = subprocess.run(
        [kubectl_binary(), "--kubeconfig", str(KUBECONFIG), *args],
        input=stdin, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    if check and done.returncode != 0:
        raise RuntimeError(f"kubectl {' '.join(args)}: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


def apply(objects: Iterable[dict[str, Any]], namespace: str | None = None, *, validate: bool = True) -> None:
    """``kubectl apply`` of ``objects`` (namespaced ones without a namespace go to ``namespace``); without
    ``validate`` kubectl's client-side schema check is skipped (the server's still applies)."""
    where = ["-n", namespace] if namespace else []
    check = [] if validate else ["--validate=false"]
    kubectl("apply", *where, *check, "-f", "-", stdin=yaml.safe_dump_all(list(objects), sort_keys=False))


def get(kind: str, name: str, namespace: str | None = None) -> dict[str, Any] | None:
    """The object, or None when it does not exist."""
    where = ["-n", namespace] if namespace else []
    out = kubectl("get", kind, name, *where, "-o", "json", "--ignore-not-found")
    return json.loads(out) if out.strip() else None


def items(kind: str, namespace: str, selector: str) -> list[dict[str, Any]]:
    listed: list[dict[str, Any]] = json.loads(kubectl("get", kind, "-n", namespace, "-l", selector, "-o", "json"))[
        "items"
    ]
    return listed


def wait_for(what: str, probe: Callable[[], T | None], timeout: float, describe: Callable[[], str]) -> T:
    """tests.k8s.cluster's wait, polling a real cluster every few seconds."""
    return cluster_wait_for(what, probe, timeout, POLL_SECONDS, describe)


def host_claim(namespace: str, name: str, directory: Path) -> list[dict[str, Any]]:
    """A PersistentVolume on ``directory`` of this machine (the node), bound to the claim ``name``. The trainer
    runs as uid 10001 and hostPath volumes get no fsGroup: the directory is made writable to it."""
    directory.mkdir(parents=True, exist_ok=True)
    for path in (directory, *directory.rglob("*")):
        path.chmod(0o777 if path.is_dir() else 0o666)
    volume = f"{namespace}-{name}"
    size = {"storage": "1Gi"}
    return [
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": volume, "labels": {E2E_LABEL: "true"}},
            "spec": {
                "capacity": size,
                "accessModes": ["ReadWriteOnce"],
                "persistentVolumeReclaimPolicy": "Retain",
                "storageClassName": "",
                "hostPath": {"path": str(directory), "type": "Directory"},
                "claimRef": {"namespace": namespace, "name": name},
            },
        },
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {
                "accessModes": ["ReadWriteOnce"],
                "storageClassName": "",
                "volumeName": volume,
                "resources": {"requests": size},
            },
        },
    ]


def namespace(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}


class _Pipe(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        with socket.create_connection(("127.0.0.1", API_PORT)) as upstream:
            pumps = [threading.Thread(target=_pump, args=pair, daemon=True)
                     for pair in ((self.request, upstream), (upstream, self.request))]  # fmt: skip
            for pump in pumps:
                pump.start()
            for pump in pumps:
                pump.join()


def _pump(source: socket.socket, sink: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := source.recv(65536):
            sink.sendall(data)
    with contextlib.suppress(OSError):
        sink.shutdown(socket.SHUT_WR)


class ApiBridge(socketserver.ThreadingTCPServer):
    """In-cluster access to the API server for the operator's pods. The node's API server listens on loopback
    only and runs with ``--endpoint-reconciler-type=none``, so its ``kubernetes`` Service (10.96.0.1:443, in
    its certificate) has no endpoints: this forwards the bridge's address to the API server, and
    :func:`api_endpoints` points the Service there. TLS stays end to end (bytes are copied, not read)."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self) -> None:
        super().__init__((BRIDGE_ADDRESS, API_PORT), _Pipe)
        threading.Thread(target=self.serve_forever, daemon=True).start()


def api_endpoints() -> dict[str, Any]:
    """The ``kubernetes`` Service's Endpoints: the :class:`ApiBridge`."""
    return {
        "apiVersion": "v1",
        "kind": "Endpoints",
        "metadata": {"name": "kubernetes", "namespace": "default"},
        "subsets": [{"addresses": [{"ip": BRIDGE_ADDRESS}], "ports": [{"name": "https", "port": API_PORT}]}],
    }
