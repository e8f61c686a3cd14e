"""``memfit run JOB.yaml --local``: plan for this machine, render the trainer's config as the operator
would, check what the trainer would refuse at start-up, and run the trainer under torchrun.

Each PersistentVolumeClaim the job names stands for a directory: the one ``--mount CLAIM=DIR`` gives, else
the directory of that name beside the job file. As in a pod, every path stays inside its claim's directory,
symlinks resolved: a claim name must be a Kubernetes name (no ``/``, no ``..``), a claim directory beside the
job file must not lead out of the job's directory, and the output directory, the data and the work
directory must not lead out of their claim's directory. The trainer config is written to a new file that
then replaces ``trainer-config.json`` (a symlink planted there is replaced, never followed).

Before torchrun starts the ranks (and with ``--dry-run`` too: it is how a job is checked without training),
the trainer's own start-up checks run in one process (``python -m memfit_trainer.launch_check``; the core
imports no torch): the config against this machine, the tokenizer, the model's config, the training and
validation data against one micro-batch per rank. What they refuse is the trainer's one line and exit 2.

One run per output directory (memfit.contract.output_lock): an output directory another run holds is refused
in one line naming it (exit 2) before anything is written. torchrun runs in a session of its own, tied to
this process (memfit.contract.lifetime): SIGTERM, SIGINT (Ctrl-C) and SIGHUP reach memfit only, which passes
them to torchrun, whose ranks then checkpoint the step they are at and stop (memfit exits 128 + the signal);
if memfit itself is killed, the kernel sends torchrun SIGTERM, with the same effect. A second signal ends
torchrun at once, and with it the ranks (each gets SIGTERM when torchrun ends: its second signal, which ends it
without a checkpoint). No rank outlives memfit.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import IO

from pydantic import ValidationError

from memfit.api.finetunejob import FineTuneJob, FineTuneJobSpec
from memfit.api.loading import InputError, describe_validation_error, load_documents
from memfit.api.plan import PlanCandidate
from memfit.api.runtime import Runtime
from memfit.cli.exit_codes import ExitCode
from memfit.cli.local_machine import inspect_machine, local_pool
from memfit.cli.model_profiles import ProfileFailed, directory_profile
from memfit.contract.lifetime import end_with_parent, stop_seconds
from memfit.contract.model_match import model_directory_problem
from memfit.contract.output_lock import lock_holder
from memfit.contract.sections import MetricsConfig
from memfit.contract.termination import (
    CONFIG_ERROR_PREFIX,
    config_error_message,
    read_termination_message,
    stopped_description,
)
from memfit.contract.trainer_config import TrainerConfig
from memfit.planned_model import PlannedModel
from memfit.planner.search import PlanningError, plan_job
from memfit.profiled_model import ProfiledModel
from memfit.render.trainer_config import Mounts, inside, model_config, render_trainer_config

DEFAULT_CPU_RANKS = 2
CLAIM_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
"""A PersistentVolumeClaim's name: an RFC 1123 subdomain (at most 253 characters)."""
CONFIG_FILE = "trainer-config.json"
TRAINER_WRITES = ("termination-log",)
"""Files of the work directory the trainer opens for writing in place (progress.json is replaced by rename)."""
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
"""What memfit passes on to torchrun (which stops its ranks on each)."""


def _claim_name(claim: object, where: str) -> str:
    if not isinstance(claim, str) or len(claim) > 253 or not CLAIM_NAME.fullmatch(claim):
        raise InputError(f"{where}: {claim!r} is not a PersistentVolumeClaim name (lower-case letters, digits, "
                         "'-' and '.', as Kubernetes names them)")  # fmt: skip
    return claim


def _within(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def contained(path: Path, root: Path, what: str) -> Path:
    """``path`` with its symlinks resolved, which must stay inside ``root`` (resolved too)."""
    resolved, resolved_root = path.resolve(), root.resolve()
    if not _within(resolved, resolved_root):
        raise InputError(f"{what} {path} leads to {resolved}, outside {resolved_root}")
    return resolved


def parse_mounts(job_file: Path, values: list[str]) -> dict[str, Path]:
    """``NAME=DIR`` pairs standing in for PersistentVolumeClaims; unnamed claims default to a
    directory of that name beside the job file."""
    mounts: dict[str, Path] = {}
    for value in values:
        name, separator, directory = value.partition("=")
        if not separator or not name or not directory:
            raise InputError(f"--mount {value!r}: expected CLAIM=DIRECTORY")
        mounts[_claim_name(name, f"--mount {value!r}")] = Path(directory).resolve()
    return mounts


def _claim_dir(job_file: Path, mounts: dict[str, Path], claim: str | None, field: str) -> str | None:
    if claim is None:
        return None
    if claim in mounts:
        return str(mounts[claim])
    job_dir = job_file.parent.resolve()
    beside = job_dir / _claim_name(claim, field)
    return str(contained(beside, job_dir, f"{field} {claim!r}: the claim's directory"))


def model_claim_directory(job: FineTuneJob, job_file: Path, mounts: dict[str, Path]) -> str | None:
    """The directory standing in for the model's claim, None when the model is not on one (the Hub)."""
    source = job.spec.model.source
    return _claim_dir(job_file, mounts, source.pvc if source else None, "model.source.pvc")


def profiled_model(job: FineTuneJob, model_claim: str | None) -> ProfiledModel | None:
    """None when the job types the model's sizes; else the model as its profile describes it, made from the
    config.json in the model's directory on its claim (cached: memfit.cli.model_profiles)."""
    if job.spec.model.architecture is not None:
        return None
    if model_claim is None:
        raise InputError(
            "spec.model.architecture is not given and the model is not on a claim (model.source.pvc): memfit "
            "plans it from its config.json on the claim and downloads nothing; give the architecture, or put "
            "the model on a claim"
        )
    name = model_config(job.spec.model, model_claim).name_or_path
    directory = contained(Path(name), Path(model_claim), "model.source.path: the model")
    return ProfiledModel(directory_profile(directory, job.spec.lora.target_modules, _say))


def _say(line: str) -> None:
    print(f"memfit: {line}", file=sys.stderr)


def local_mounts(job: FineTuneJob, job_file: Path, mounts: dict[str, Path]) -> Mounts:
    spec = job.spec
    data = _claim_dir(job_file, mounts, spec.dataset.source.pvc, "dataset.source.pvc")
    if data is None:
        raise InputError("--local needs the dataset on a volume (dataset.source.pvc): Hub datasets are not fetched")
    output = _claim_dir(job_file, mounts, spec.output.pvc, "output.pvc")
    if output is None:
        raise InputError("output.pvc: required")
    return Mounts(model=model_claim_directory(job, job_file, mounts), data=data, output=output)


def _check_paths(config: TrainerConfig, mounts: Mounts) -> None:
    """What the trainer will read and write stays inside its claim's directory, symlinks resolved."""
    contained(Path(config.output_dir), Path(mounts.output), "output.path: the output directory")
    contained(Path(config.data.path), Path(mounts.data), "dataset.source.path: the data")
    if config.volumes is not None and config.volumes.model is not None:
        contained(Path(config.model.name_or_path), Path(config.volumes.model), "model.source.path: the model")


def check_model(job: FineTuneJob, mounts: Mounts, planned: PlannedModel | None = None) -> None:
    """The model directory on its claim exists, holds config.json, and that config is the shape (or, planned
    from a profile, the config.json) the plan was made for (memfit.contract.model_match, as the trainer checks
    it): before anything is written."""
    if mounts.model is None or job.spec.model.random_init:
        return
    model = model_config(job.spec.model, mounts.model)
    directory = contained(Path(model.name_or_path), Path(mounts.model), "model.source.path: the model")
    fields = planned.planned_fields() if planned is not None else None
    problem = model_directory_problem(directory, model.architecture, fields)
    if problem is not None:
        raise InputError(problem)


def _work_directory(workdir: Path | None, output_dir: Path) -> Path:
    """The given ``--workdir`` (the user's choice), else ``OUTPUT/.memfit``, which must stay in the output."""
    if workdir is not None:
        workdir = workdir.resolve()
        workdir.mkdir(parents=True, exist_ok=True)
        return workdir
    default = output_dir / ".memfit"
    contained(default, output_dir, "the work directory")
    default.mkdir(parents=True, exist_ok=True)
    return contained(default, output_dir, "the work directory")


def write_config_file(directory: Path, text: str) -> Path:
    """``directory/trainer-config.json`` replaced by a new file in one rename: whatever was there (a symlink
    to another file included) is replaced, never written through."""
    target = directory / CONFIG_FILE
    fd, temp = tempfile.mkstemp(dir=directory, prefix=f".{CONFIG_FILE}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)  # as a plain write would leave it (mkstemp makes it private)
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.replace(temp, target)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
    for name in TRAINER_WRITES:  # the trainer would write through a symlink planted here: remove the link
        planted = directory / name
        if planted.is_symlink():
            planted.unlink()
    return target


def single_job(path: Path, name: str | None) -> FineTuneJob:
    jobs = load_documents(path).jobs
    if name is not None:
        jobs = [job for job in jobs if job.metadata.name == name]
    if len(jobs) != 1:
        raise InputError(f"{path}: expected exactly one FineTuneJob{f' named {name!r}' if name else ''}")
    return jobs[0]


def fewer_ranks(spec: FineTuneJobSpec, chosen: PlanCandidate, ranks: int) -> str:
    """Why the plan uses fewer ranks than the machine offers: the batch does not split over them, or a plan
    on fewer is the fastest that fits."""
    batch, micro = spec.training.global_batch_size, spec.strategy.micro_batch_size
    uses = f"the plan uses {chosen.strategy.gpus} of {ranks} ranks"
    if batch % ranks:
        return f"{uses}: globalBatchSize {batch} does not divide over {ranks}"
    if micro is not None and (batch // ranks) % micro:
        return f"{uses}: strategy.microBatchSize {micro} does not divide the {batch // ranks} rows per rank of {ranks}"
    return f"{uses}: it is the fastest plan that fits here (`memfit plan` lists the others)"


def run_local(job_file: Path, ranks: int | None, mount_args: list[str], workdir: Path | None, dry_run: bool) -> int:
    machine = inspect_machine()
    ranks = ranks or (len(machine.gpu_names) if machine.has_gpus else min(DEFAULT_CPU_RANKS, machine.cpus))
    try:
        job = single_job(job_file, None)
        mounts = local_mounts(job, job_file, parse_mounts(job_file, mount_args))
        output_dir = contained(
            Path(inside(mounts.output, job.spec.output.path)), Path(mounts.output), "output.path: the output directory"
        )
        spec = job.spec.model_copy(
            update={"resources": job.spec.resources.model_copy(update={"pool": "local", "max_gpus": ranks})}
        )
        pool = local_pool(machine, ranks)
        planned = profiled_model(job, mounts.model)
        result = plan_job(spec, [pool], model=planned, runtime=Runtime.local())
    except ProfileFailed as error:
        print(f"memfit run: error: {error}", file=sys.stderr)
        return error.exit_code
    except (InputError, PlanningError, ValueError) as error:
        print(f"memfit run: error: {error}", file=sys.stderr)
        return ExitCode.BAD_INPUT
    if result.chosen is None:
        print("memfit run: nothing fits this machine:", file=sys.stderr)
        for line in result.advice:
            print(f"  - {line}", file=sys.stderr)
        return ExitCode.NO_FIT
    if result.chosen.strategy.gpus != ranks:
        print(f"memfit run: {fewer_ranks(job.spec, result.chosen, ranks)}", file=sys.stderr)
        ranks = result.chosen.strategy.gpus

    holder = lock_holder(output_dir)
    if holder is not None:
        print(f"memfit run: error: {holder}", file=sys.stderr)
        return ExitCode.BAD_INPUT
    try:
        check_model(job, mounts, planned)
        workdir = _work_directory(workdir, output_dir)
        config = render_trainer_config(
            job, result.chosen, mounts=mounts,
            metrics=MetricsConfig(port=0, progress_file=str(workdir / "progress.json")),
            termination_log=str(workdir / "termination-log"), planned=planned, devices=pool.spec.devices,
        )  # fmt: skip
        _check_paths(config, mounts)
        config_path = write_config_file(workdir, config.to_json())
    except ValidationError as error:  # a job object that bypassed the API's validation
        print(f"memfit run: error: the trainer config: {describe_validation_error(error)}", file=sys.stderr)
        return ExitCode.BAD_INPUT
    except (InputError, ValueError) as error:
        print(f"memfit run: error: {error}", file=sys.stderr)
        return ExitCode.BAD_INPUT
    except OSError as error:
        print(f"memfit run: error: cannot write the trainer config: {error}", file=sys.stderr)
        return ExitCode.BAD_INPUT
    device = "GPU(s)" if machine.has_gpus else "CPU process(es)"
    print(f"memfit run: {result.chosen.strategy.summary()} ({ranks} {device})")
    print(f"memfit run: trainer config {config_path}")
    env = trainer_env(machine.has_gpus)
    env.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(stop_seconds(result.chosen)))
    _say(f"checking the model, the tokenizer and the data as {ranks} rank(s) will load them")
    refused = launch_check(config_path, env)
    if refused is not None:
        code, line = refused
        print(f"memfit run: error: {line}", file=sys.stderr)
        return code
    if dry_run:
        return 0
    return _torchrun(config_path, ranks, env, Path(config.termination_log))


def trainer_env(has_gpus: bool) -> dict[str, str]:
    """The environment of the trainer's processes (the launch check's too): ours, plus one thread per rank, the
    Hub offline (a model comes from its claim or the local cache, never a download) and, without GPUs,
    DeepSpeed on the CPU, unless already set."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    if not has_gpus:
        env.setdefault("DS_ACCELERATOR", "cpu")
    return env


def launch_check(config_path: Path, env: dict[str, str]) -> tuple[ExitCode, str] | None:
    """None when the trainer would start (memfit_trainer.launch_check); else the exit code and the line to say:
    the trainer's own refusal (exit 2), or how the check itself failed (a bug: exit 3). What the check printed
    while passing (datasets' progress bars) is dropped."""
    command = [sys.executable, "-m", "memfit_trainer.launch_check", "--config", str(config_path)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode == 0:
        return None
    lines = done.stderr.strip().splitlines()
    refusals = [line.removeprefix(CONFIG_ERROR_PREFIX) for line in lines if line.startswith(CONFIG_ERROR_PREFIX)]
    if done.returncode == ExitCode.BAD_INPUT and refusals:
        return ExitCode.BAD_INPUT, refusals[-1]
    said = lines[-1] if lines else "nothing said"
    return ExitCode.INTERNAL_ERROR, f"the trainer's launch check failed (exit {done.returncode}): {said}"


def relay_stderr(stream: IO[bytes], stopping: Callable[[], bool] = lambda: False) -> str | None:
    """Copy torchrun's stderr (its ranks' too) to ours as it comes, until a rank refuses its config
    (memfit-train's one line) or memfit passed on a stop signal (``stopping()``): what follows is torchrun's
    report of the failed ranks, or of the signal it got, withheld. The first refusal's message, or None."""
    refused: str | None = None
    for raw in stream:
        line = raw.decode("utf-8", errors="replace")
        if refused is None and line.startswith(CONFIG_ERROR_PREFIX):
            refused = line.removeprefix(CONFIG_ERROR_PREFIX).rstrip("\n")
        if refused is None and not stopping():
            sys.stderr.write(line)
            sys.stderr.flush()
    return refused


def _tied_to(parent: int) -> Callable[[], None]:
    """torchrun's pre-exec hook: SIGTERM when ``parent`` ends; exit at once if it already has."""
    return lambda: end_with_parent(parent)


def _start_torchrun(command: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    """torchrun in a session of its own (a signal to memfit's process group reaches memfit only, which passes
    it on: :func:`_forwarding_signals`), sent SIGTERM by the kernel when memfit ends, however it ends."""
    return subprocess.Popen(
        command, env=env, stderr=subprocess.PIPE, start_new_session=True, preexec_fn=_tied_to(os.getpid())
    )


@contextlib.contextmanager
def _forwarding_signals(process: subprocess.Popen[bytes]) -> Iterator[list[signal.Signals]]:
    """While inside: :data:`FORWARDED_SIGNALS` go to ``process`` instead of ending memfit; the signals
    received, in order."""
    received: list[signal.Signals] = []

    def forward(signum: int, frame: FrameType | None) -> None:
        received.append(signal.Signals(signum))
        if process.returncode is None:
            process.send_signal(signum)

    previous = {forwarded: signal.signal(forwarded, forward) for forwarded in FORWARDED_SIGNALS}
    try:
        yield received
    finally:
        for forwarded, handler in previous.items():
            signal.signal(forwarded, handler)


def _stopped(received: signal.Signals, termination_log: Path) -> int:
    """What memfit says and returns after passing a stop signal to the ranks: 128 + the signal, as a shell
    reports a process it ended."""
    said = stopped_description(read_termination_message(termination_log))
    print(f"memfit run: {said or f'stopped by {received.name}'}; the same command resumes", file=sys.stderr)
    return 128 + received.value


def _torchrun(config_path: Path, ranks: int, env: dict[str, str], termination_log: Path) -> int:
    """Run the trainer's ranks; a start-up refusal (exit 2 and a ConfigError termination message) comes back
    as the trainer's one line and exit 2, not as torchrun's report of failed workers."""
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    command = [torchrun, "--standalone", f"--nproc-per-node={ranks}", "-m", "memfit_trainer.main",
               "--config", str(config_path)]  # fmt: skip
    termination_log.unlink(missing_ok=True)  # an earlier run's message is not this run's
    with _start_torchrun(command, env) as process, _forwarding_signals(process) as received:
        assert process.stderr is not None  # stderr=PIPE
        try:
            refused = relay_stderr(process.stderr, stopping=lambda: bool(received))
        except BaseException:
            process.terminate()  # stopped, never left training (the context then waits for it)
            raise
    if received:
        return _stopped(received[0], termination_log)
    if process.returncode == 0:
        return 0
    message = config_error_message(termination_log) or refused
    if message is None:
        return process.returncode
    print(f"memfit run: error: {message}", file=sys.stderr)
    return ExitCode.BAD_INPUT
