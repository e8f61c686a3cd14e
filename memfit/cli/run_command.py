"""``memfit run JOB.yaml --local``: plan for this machine, render the trainer's config as the operator
would, and run the trainer under torchrun."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from memfit.api.finetunejob import FineTuneJob
from memfit.api.loading import InputError, load_documents
from memfit.cli.exit_codes import ExitCode
from memfit.cli.local_machine import inspect_machine, local_pool
from memfit.contract.trainer_config import MetricsConfig
from memfit.planner.search import PlanningError, plan_job
from memfit.render.trainer_config import Mounts, inside, render_trainer_config

DEFAULT_CPU_RANKS = 2


def parse_mounts(job_file: Path, values: list[str]) -> dict[str, Path]:
    """``NAME=DIR`` pairs standing in for PersistentVolumeClaims; unnamed claims default to a
    directory of that name beside the job file."""
    mounts: dict[str, Path] = {}
    for value in values:
        name, separator, directory = value.partition("=")
        if not separator or not name or not directory:
            raise InputError(f"--mount {value!r}: expected CLAIM=DIRECTORY")
        mounts[name] = Path(directory).resolve()
    return mounts


def _claim_dir(job_file: Path, mounts: dict[str, Path], claim: str | None) -> str | None:
    if claim is None:
        return None
    return str(mounts.get(claim, job_file.parent.resolve() / claim))


def local_mounts(job: FineTuneJob, job_file: Path, mounts: dict[str, Path]) -> Mounts:
    spec = job.spec
    model_claim = spec.model.source.pvc if spec.model.source else None
    data = _claim_dir(job_file, mounts, spec.dataset.source.pvc)
    if data is None:
        raise InputError("--local needs the dataset on a volume (dataset.source.pvc): Hub datasets are not fetched")
    output = _claim_dir(job_file, mounts, spec.output.pvc)
    assert output is not None
    return Mounts(model=_claim_dir(job_file, mounts, model_claim), data=data, output=output)


def _single_job(path: Path, name: str | None) -> FineTuneJob:
    jobs = load_documents(path).jobs
    if name is not None:
        jobs = [job for job in jobs if job.metadata.name == name]
    if len(jobs) != 1:
        raise InputError(f"{path}: expected exactly one FineTuneJob{f' named {name!r}' if name else ''}")
    return jobs[0]


def run_local(job_file: Path, ranks: int | None, mount_args: list[str], workdir: Path | None, dry_run: bool) -> int:
    machine = inspect_machine()
    ranks = ranks or (len(machine.gpu_names) if machine.has_gpus else min(DEFAULT_CPU_RANKS, machine.cpus))
    try:
        job = _single_job(job_file, None)
        mounts = local_mounts(job, job_file, parse_mounts(job_file, mount_args))
        spec = job.spec.model_copy(
            update={"resources": job.spec.resources.model_copy(update={"pool": "local", "max_gpus": ranks})}
        )
        pool = local_pool(machine, ranks)
        result = plan_job(spec, [pool])
    except (InputError, PlanningError, ValueError) as error:
        print(f"memfit run: error: {error}", file=sys.stderr)
        return ExitCode.BAD_INPUT
    if result.chosen is None:
        print("memfit run: nothing fits this machine:", file=sys.stderr)
        for line in result.advice:
            print(f"  - {line}", file=sys.stderr)
        return ExitCode.NO_FIT
    if result.chosen.strategy.gpus != ranks:
        print(f"memfit run: the plan uses {result.chosen.strategy.gpus} of {ranks} ranks "
              "(globalBatchSize must be divisible by the rank count)", file=sys.stderr)  # fmt: skip
        ranks = result.chosen.strategy.gpus

    workdir = (workdir or Path(inside(mounts.output, job.spec.output.path)) / ".memfit").resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    config = render_trainer_config(
        job, result.chosen, mounts=mounts,
        metrics=MetricsConfig(port=0, progress_file=str(workdir / "progress.json")),
        termination_log=str(workdir / "termination-log"),
    )  # fmt: skip
    config_path = workdir / "trainer-config.json"
    config_path.write_text(config.to_json())
    device = "GPU(s)" if machine.has_gpus else "CPU process(es)"
    print(f"memfit run: {result.chosen.strategy.summary()} ({ranks} {device})")
    print(f"memfit run: trainer config {config_path}")
    if dry_run:
        return 0
    return _torchrun(config_path, ranks, machine.has_gpus)


def _torchrun(config_path: Path, ranks: int, has_gpus: bool) -> int:
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    if not has_gpus:
        env.setdefault("DS_ACCELERATOR", "cpu")
    command = [torchrun, "--standalone", f"--nproc-per-node={ranks}", "-m", "memfit_trainer.main",
               "--config", str(config_path)]  # fmt: skip
    return subprocess.run(command, env=env, check=False).returncode
