"""The Dockerfile, checked without a Docker engine: two targets, non-root, a torch-free operator, the
trainer installed with the same steps and pins as the Makefile's `setup` (what CI builds and tests), and the
build arguments `make images` builds them with here (local bases, the CPU trainer) leaving the production
defaults as they are."""

from __future__ import annotations

import re
import shlex
import tomllib
from dataclasses import dataclass, field

import pytest
from dockerfile_parse import DockerfileParser

from tests.chart.render import ROOT

POD_USER = 10001
"""The uid the chart's Deployment and the operator's trainer pods run as."""


@dataclass
class Stage:
    base: str
    args: dict[str, str] = field(default_factory=dict)
    env: str = ""
    runs: list[str] = field(default_factory=list)
    copies: list[list[str]] = field(default_factory=list)
    user: str | None = None
    entrypoint: str | None = None
    cmd: str | None = None


GLOBAL = ""
"""The stage name under which the ARGs before the first FROM are kept (the ones a FROM line can use)."""


def stages() -> dict[str, Stage]:
    parser = DockerfileParser(str(ROOT / "Dockerfile"))
    found: dict[str, Stage] = {GLOBAL: Stage(base="")}
    current = found[GLOBAL]
    for instruction in parser.structure:
        kind, value = instruction["instruction"], instruction["value"]
        if kind == "FROM":
            base, _, name = value.partition(" AS ")
            current = found.setdefault(name.strip(), Stage(base.strip()))
        elif kind == "ARG" and "=" in value:
            key, default = value.split("=", 1)
            current.args[key] = default
        elif kind == "ENV":
            current.env += " " + value
        elif kind == "RUN":
            current.runs.append(" ".join(value.split()))
        elif kind == "COPY":
            current.copies.append(value.split())
        elif kind == "USER":
            current.user = value
        elif kind == "ENTRYPOINT":
            current.entrypoint = value
        elif kind == "CMD":
            current.cmd = value
    return found


def base_image(dockerfile: dict[str, Stage], target: str, **build_args: str) -> str:
    """The image a target is built on: its FROM line with the global ARGs (their defaults, or the build
    arguments given) substituted, followed through the stages it names."""
    args = dockerfile[GLOBAL].args | build_args
    base = dockerfile[target].base
    while "${" in base:
        base = re.sub(r"\$\{(\w+)\}", lambda match: args[match.group(1)], base)
    return base_image(dockerfile, base, **build_args) if base in dockerfile else base


def makefile_variable(name: str) -> str:
    match = re.search(rf"^{name} \?= (.+)$", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert match, f"Makefile has no {name}"
    return match.group(1).strip()


def pip_installs(stage: Stage) -> list[list[str]]:
    """The arguments of every `python -m pip install` in the stage's RUN steps."""
    installs = []
    for run in stage.runs:
        for command in run.split("&&"):
            words = shlex.split(command)
            if "pip" in words and "install" in words:
                installs.append(words[words.index("install") + 1 :])
    return installs


@pytest.fixture(scope="module")
def dockerfile() -> dict[str, Stage]:
    return stages()


def test_two_targets_on_the_production_bases_by_default(dockerfile: dict[str, Stage]) -> None:
    assert {"operator", "trainer"} <= set(dockerfile)
    assert base_image(dockerfile, "operator") == "python:3.11-slim"
    assert re.fullmatch(r"nvidia/cuda:[0-9.]+-cudnn-devel-ubuntu[0-9.]+", base_image(dockerfile, "trainer"))
    assert "DS_ACCELERATOR" not in dockerfile["trainer-cuda"].env + dockerfile["trainer"].env  # DeepSpeed detects


def test_build_arguments_replace_the_bases(dockerfile: dict[str, Stage]) -> None:
    local = {"OPERATOR_BASE": "localhost/debian", "TRAINER_BASE": "localhost/debian"}
    assert base_image(dockerfile, "operator", **local) == "localhost/debian"
    for variant in ("cuda", "cpu"):
        assert base_image(dockerfile, "trainer", **local, TRAINER_VARIANT=variant) == "localhost/debian"


def test_cpu_trainer_names_deepspeeds_cpu_accelerator(dockerfile: dict[str, Stage]) -> None:
    """The CPU variant's own stage sets the accelerator (the ops are built for it, and a pod needs no
    detection); the shared steps check the ops of the variant built, the CPU's shared-memory op included."""
    assert "DS_ACCELERATOR=cpu" in dockerfile["trainer-cpu"].env.split()
    (build,) = [run for run in dockerfile["trainer"].runs if "'.[trainer]'" in run]
    assert "DS_BUILD_SHM_COMM=1" in build and "DS_ACCELERATOR=${TRAINER_VARIANT}" in build
    assert "'deepspeed_shm_comm'" in build and "g++" in " ".join(dockerfile["trainer"].runs)


def test_make_images_builds_the_operator_and_the_cpu_trainer_on_the_local_base() -> None:
    makefile = (ROOT / "Makefile").read_text()
    recipe = makefile.split("\nimages:\n", 1)[1].split("\n\n", 1)[0]
    assert "images/base.sh $(BASE_IMAGE)" in recipe and "--target operator" in recipe
    assert "--build-arg TRAINER_VARIANT=cpu" in recipe and "TORCH_VERSION=$(patsubst torch==%,%,$(TORCH))+cpu" in recipe
    for base in ("OPERATOR_BASE", "TRAINER_BASE"):
        assert f"--build-arg {base}=$(BASE_IMAGE)" in makefile


@pytest.mark.parametrize("target", ["operator", "trainer"])
def test_runs_as_the_pods_non_root_user(dockerfile: dict[str, Stage], target: str) -> None:
    stage = dockerfile[target]
    assert stage.user is not None and stage.user.split(":")[0] == str(POD_USER)
    assert any(f"useradd --uid {POD_USER}" in run for run in stage.runs)


def test_entrypoints_are_the_project_scripts(dockerfile: dict[str, Stage]) -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert dockerfile["operator"].entrypoint == '["memfit"]' and dockerfile["operator"].cmd == '["operator"]'
    assert dockerfile["trainer"].entrypoint == '["memfit-train"]'
    assert {"memfit", "memfit-train"} <= set(scripts)


@pytest.mark.parametrize("target", ["operator", "trainer"])
def test_each_image_copies_the_core_and_only_its_own_package(dockerfile: dict[str, Stage], target: str) -> None:
    """The operator image has no trainer code and the trainer image no operator code; the package search
    looks in both folders (and finds nothing in the one an image lacks)."""
    sources = {source for words in dockerfile[target].copies for source in words[:-1] if not source.startswith("--")}
    assert sources == {"pyproject.toml", "README.md", "memfit", target}
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    assert set(find["where"]) == {".", "operator", "trainer"}


def test_operator_image_has_no_torch(dockerfile: dict[str, Stage]) -> None:
    stage = dockerfile["operator"]
    assert not any("torch" in run or "[trainer" in run or "deepspeed" in run for run in stage.runs)
    assert pip_installs(stage)[-1] == [".[operator]"]
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert not any(re.match(r"(torch|deepspeed|bitsandbytes)\b", dep) for dep in extras["operator"])


def test_trainer_installs_like_the_makefile(dockerfile: dict[str, Stage]) -> None:
    """Makefile setup: pip/setuptools/wheel upgraded, "$(TORCH)" first, then memfit --no-build-isolation."""
    stage = dockerfile["trainer"]
    installs = pip_installs(stage)
    makefile = (ROOT / "Makefile").read_text()
    assert "pip install --quiet --upgrade pip setuptools wheel" in makefile
    assert installs[0] == ["--upgrade", "pip", "setuptools", "wheel"]
    torch_pin = makefile_variable("TORCH")  # torch==X.Y.Z
    assert installs[1][0] == "torch==${TORCH_VERSION}" and f"torch=={stage.args['TORCH_VERSION']}" == torch_pin
    assert "--no-build-isolation -e '.[operator,trainer,dev]'" in makefile
    assert installs[2] == ["--no-build-isolation", ".[trainer]"]
    assert any("-m venv /opt/memfit" in run for run in stage.runs) and "PATH=/opt/memfit/bin:$PATH" in stage.env


def test_trainer_prebuilds_deepspeed_ops_for_its_cuda(dockerfile: dict[str, Stage]) -> None:
    stage = dockerfile["trainer"]
    (build,) = [run for run in stage.runs if "'.[trainer]'" in run]
    for op in ("DS_BUILD_CPU_ADAM=1", "DS_BUILD_FUSED_ADAM=1", "DS_BUILD_AIO=1", "TORCH_CUDA_ARCH_LIST="):
        assert op in build
    assert "installed_ops" in build  # the build fails if an op was not compiled
    cuda = re.search(r"nvidia/cuda:(\d+)\.(\d+)", base_image(dockerfile, "trainer"))
    index = re.search(r"/whl/cu(\d+)$", stage.args["TORCH_INDEX"])
    assert cuda and index and index.group(1) == cuda.group(1) + cuda.group(2), "torch's CUDA differs from nvcc's"
    assert any("libaio-dev" in run for run in stage.runs)  # async I/O (NVMe offload) links against it
    assert "TORCH_EXTENSIONS_DIR=/tmp/" in stage.env  # writable by the non-root user (the pod mounts /tmp)
