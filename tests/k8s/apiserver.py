"""A real kube-apiserver + etcd for tests, from the envtest convention (``KUBEBUILDER_ASSETS`` = a folder
with ``kube-apiserver`` and ``etcd``; ``hack/envtest-assets`` builds one, users may bring their
own). Loopback only, free ports, a fresh data directory, a static admin token."""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import yaml


class EnvtestUnavailable(RuntimeError):
    """KUBEBUILDER_ASSETS is not set or does not hold the binaries."""


OPERATOR_NAMESPACE, OPERATOR_SERVICE_ACCOUNT = "memfit-system", "memfit-operator"
"""The identity the operator runs as in tests: the chart's ServiceAccount. A static token whose user name is
the ServiceAccount's (system:serviceaccount:NS:NAME) is authorised by RBAC exactly like the ServiceAccount
itself, with no token controller (there is none here)."""


@dataclass(frozen=True)
class ApiServer:
    url: str
    token: str
    ca_file: Path
    kubeconfig: Path
    """Admin (system:masters): the test's own identity."""
    operator_kubeconfig: Path
    """The operator's ServiceAccount: only what RBAC grants it."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _assets() -> Path:
    folder = os.environ.get("KUBEBUILDER_ASSETS")
    if not folder:
        raise EnvtestUnavailable(
            "KUBEBUILDER_ASSETS is not set: `make test` sets it from hack/envtest-assets, or point it at "
            "a folder with kube-apiserver and etcd"
        )
    path = Path(folder)
    missing = [name for name in ("kube-apiserver", "etcd") if not (path / name).exists()]
    if missing:
        raise EnvtestUnavailable(f"KUBEBUILDER_ASSETS={folder} lacks {', '.join(missing)}")
    return path


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def _certificates(directory: Path) -> None:
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=127.0.0.1",
             "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(directory / "server.key"),
             "-out", str(directory / "server.crt"))  # fmt: skip
    _openssl("genrsa", "-out", str(directory / "sa.key"), "2048")
    _openssl("rsa", "-in", str(directory / "sa.key"), "-pubout", "-out", str(directory / "sa.pub"))


def _wait_ready(url: str, token: str, ca_file: Path, process: subprocess.Popen[bytes], timeout: float = 60) -> None:
    context = ssl.create_default_context(cafile=str(ca_file))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"kube-apiserver exited with {process.returncode}")
        request = urllib.request.Request(f"{url}/readyz", headers={"Authorization": f"Bearer {token}"})
        try:
            with urllib.request.urlopen(request, context=context, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"kube-apiserver not ready within {timeout:.0f} s")


def _kubeconfig(url: str, ca_file: Path, user: str, token: str) -> str:
    return yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "envtest",
        "clusters": [{"name": "envtest", "cluster": {"server": url, "certificate-authority": str(ca_file)}}],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": "envtest", "context": {"cluster": "envtest", "user": user}}]})  # fmt: skip


@contextmanager
def running_apiserver() -> Iterator[ApiServer]:
    assets = _assets()
    directory = Path(tempfile.mkdtemp(prefix="memfit-envtest-"))
    processes: list[subprocess.Popen[bytes]] = []
    try:
        _certificates(directory)
        token = secrets.token_hex(16)
        operator_token = secrets.token_hex(16)
        operator_user = f"system:serviceaccount:{OPERATOR_NAMESPACE}:{OPERATOR_SERVICE_ACCOUNT}"
        (directory / "tokens.csv").write_text(
            f"{token},admin,admin-uid,system:masters\n"
            f'{operator_token},{operator_user},operator-uid,"system:serviceaccounts,system:authenticated"\n'
        )
        client, peer, secure = _free_port(), _free_port(), _free_port()
        log = (directory / "etcd.log").open("w")
        processes.append(subprocess.Popen([
            str(assets / "etcd"), "--name", "t", "--data-dir", str(directory / "etcd"),
            "--listen-client-urls", f"http://127.0.0.1:{client}", "--advertise-client-urls", f"http://127.0.0.1:{client}",
            "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-cluster", f"t=http://127.0.0.1:{peer}"], stdout=log, stderr=subprocess.STDOUT))  # fmt: skip
        log = (directory / "apiserver.log").open("w")
        apiserver = subprocess.Popen([
            str(assets / "kube-apiserver"), f"--etcd-servers=http://127.0.0.1:{client}", "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1", f"--secure-port={secure}", f"--tls-cert-file={directory / 'server.crt'}",
            f"--tls-private-key-file={directory / 'server.key'}", f"--token-auth-file={directory / 'tokens.csv'}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={directory / 'sa.pub'}",
            f"--service-account-signing-key-file={directory / 'sa.key'}", "--service-cluster-ip-range=10.96.0.0/24",
            "--authorization-mode=RBAC", "--endpoint-reconciler-type=none", f"--cert-dir={directory / 'certs'}"],
            stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
        processes.append(apiserver)
        url, ca_file = f"https://127.0.0.1:{secure}", directory / "server.crt"
        _wait_ready(url, token, ca_file, apiserver)
        kubeconfig, operator_kubeconfig = directory / "kubeconfig", directory / "operator.kubeconfig"
        kubeconfig.write_text(_kubeconfig(url, ca_file, "admin", token))
        operator_kubeconfig.write_text(_kubeconfig(url, ca_file, OPERATOR_SERVICE_ACCOUNT, operator_token))
        yield ApiServer(url, token, ca_file, kubeconfig, operator_kubeconfig)
    finally:
        for process in reversed(processes):
            process.terminate()
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
        shutil.rmtree(directory, ignore_errors=True)
