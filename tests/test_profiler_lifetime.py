"""The profiler as ``memfit plan`` runs it (``memfit.cli.model_profiles.make_profile`` starts ``python -m
memfit_trainer.profile``): several profiles started at once on a loaded machine all finish, their workers forked by
a single-threaded fork server (``memfit_trainer.trace_workers``), and nothing the profiler started outlives what
started it, whether that ends normally, is killed (``kill -9``) or interrupted (Ctrl-C) mid-profile
(``memfit.contract.lifetime``). Processes are found by their parent, in /proc."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from memfit.contract.lifetime import parent_of  # noqa: E402
from memfit.profile import ModelProfile  # noqa: E402
from tests.trainer.new_families import tiny_config  # noqa: E402

FAMILIES = ("qwen3", "qwen3_moe")
"""Dense attention and experts, at tiny widths, every setup traced."""
LAUNCHER = (
    "import faulthandler, signal, sys; faulthandler.register(signal.SIGUSR1); "
    "signal.signal(signal.SIGINT, signal.default_int_handler); "
    "signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT}); "
    "from pathlib import Path; "
    "from memfit.cli.model_profiles import make_profile; print(make_profile(Path(sys.argv[1]), activations=True))"
)
"""What stands for ``memfit plan``: it profiles a model directory as ``memfit plan`` does (SIGUSR1 prints where
each of its threads is, for a launcher that does not end when it should). Its Ctrl-C is set as a shell sets a
foreground job's: a pytest worker may hand it SIGINT ignored or blocked, left so by an earlier test."""
PROFILE_SECONDS = 840
"""The bound on the profiles, under the suite's 900 s per test: a hung one never ends (three with Gated DeltaNet took 9
minutes at once on 2 cores under a load average of 9)."""
GONE_SECONDS = 30
"""How long the processes a profiler started may take to end once it has."""
WORKER_DEPTH = 3
"""memfit, the profiler, its fork server, a worker."""


def _model(directory: Path, model_type: str) -> Path:
    model = directory / model_type
    model.mkdir()
    (model / "config.json").write_text(tiny_config(model_type).to_json_string(), encoding="utf-8")
    return model


def _launch(model: Path) -> subprocess.Popen[str]:
    command = [sys.executable, "-c", LAUNCHER, str(model)]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _descendants(root: int) -> dict[int, int]:
    """Every running process below ``root``, with its depth (1: a child)."""
    parents = {int(name): parent_of(int(name)) for name in os.listdir("/proc") if name.isdigit()}
    found: dict[int, int] = {}
    level, depth = {root}, 0
    while level:
        depth += 1
        level = {pid for pid, parent in parents.items() if parent in level and pid not in found}
        found.update(dict.fromkeys(level, depth))
    return found


def _running(pid: int) -> bool:
    """Not ended (a zombie has: an orphan's new parent may take its time reaping it)."""
    return parent_of(pid) is not None


def _threads(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text(encoding="utf-8")
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("Threads:")))


def _until(condition: Callable[[], bool], seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} after {seconds} s")
        time.sleep(0.2)


def _workers_forked(launcher: subprocess.Popen[str]) -> dict[int, int]:
    """The launcher's process tree once the profiler's workers are forked; asserts the fork server that forked
    them has no thread beside its main one."""
    tree: dict[int, int] = {}

    def forked() -> bool:
        tree.update(_descendants(launcher.pid))
        return launcher.poll() is not None or WORKER_DEPTH in tree.values()

    _until(forked, PROFILE_SECONDS, "no trace worker")
    assert launcher.poll() is None, f"the profile ended before its workers were seen: {launcher.communicate()[1]}"
    servers = {parent_of(pid) for pid, depth in tree.items() if depth == WORKER_DEPTH}
    assert [_threads(server) for server in servers if server is not None] == [1] * len(servers)
    return tree


def _all_ended(pids: dict[int, int]) -> None:
    _until(lambda: not any(_running(pid) for pid in pids), GONE_SECONDS, f"some still running of {sorted(pids)}")


@pytest.mark.slow  # tiny widths, but every setup traced
def test_profiles_started_at_once_all_finish_and_leave_nothing_running(tmp_path: Path) -> None:
    launchers = {name: _launch(_model(tmp_path, name)) for name in FAMILIES}
    started = time.monotonic()
    seen = {pid: depth for launcher in launchers.values() for pid, depth in _workers_forked(launcher).items()}
    for name, launcher in launchers.items():
        try:
            out, err = launcher.communicate(timeout=max(1.0, PROFILE_SECONDS - (time.monotonic() - started)))
        except subprocess.TimeoutExpired:
            for each in launchers.values():
                each.kill()  # its profiler and workers end with it
            pytest.fail(f"{name}: no profile after {PROFILE_SECONDS} s")
        assert launcher.returncode == 0, f"{name}: {err.strip().splitlines()[-1:]}"
        profile = ModelProfile.model_validate_json(out)
        assert profile.model_type == name and profile.activations is not None
    _all_ended(seen)


@pytest.mark.slow  # two profilers started, killed once their workers are forked
def test_nothing_outlives_memfit_killed_or_interrupted_mid_profile(tmp_path: Path) -> None:
    model = _model(tmp_path, "qwen3")
    launchers = {sig: _launch(model) for sig in (signal.SIGKILL, signal.SIGINT)}
    trees = {sig: _workers_forked(launcher) for sig, launcher in launchers.items()}
    for sig, launcher in launchers.items():
        trees[sig].update(_descendants(launcher.pid))  # the second worker, forked since
        launcher.send_signal(sig)
    for sig, launcher in launchers.items():
        _ended(launcher, sig)
        assert launcher.returncode != 0, sig.name
        _all_ended(trees[sig])


def _ended(launcher: subprocess.Popen[str], sig: signal.Signals) -> None:
    """The launcher ended within :data:`GONE_SECONDS` of ``sig``; else where its threads were, then it is killed."""
    try:
        launcher.communicate(timeout=GONE_SECONDS)
    except subprocess.TimeoutExpired:
        status = Path(f"/proc/{launcher.pid}/status").read_text(encoding="utf-8")
        masks = [line for line in status.splitlines() if line.startswith(("SigBlk", "SigIgn", "SigCgt"))]
        launcher.send_signal(signal.SIGUSR1)
        time.sleep(2)
        launcher.kill()
        stacks = launcher.communicate()[1]
        pytest.fail(
            f"a launcher sent {sig.name} still ran after {GONE_SECONDS} s ({masks}); its threads:\n{stacks[-6000:]}"
        )


def test_trace_workers_start_under_a_temporary_directory_too_deep_for_a_socket(tmp_path: Path) -> None:
    """The fork server listens on a Unix socket in multiprocessing's temporary directory, whose path may not
    exceed 107 bytes: under a deeper ``TMPDIR`` (a pod's, a test's) it is made in a system one instead."""
    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    code = (
        "import multiprocessing.util, sys; from memfit_trainer.trace_workers import trace_workers\n"
        "with trace_workers(2) as pool: print(list(pool.map(abs, [-1, -2])), multiprocessing.util.get_temp_dir())"
    )
    env = {**os.environ, "TMPDIR": str(deep)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("[1, 2] ") and not done.stdout.split()[-1].startswith(str(deep)), done.stdout
