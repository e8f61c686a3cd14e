"""The Dockerfile, checked without a Docker engine: two targets, non-root, a torch-free operator, the
trainer installed with the same steps and pins as the Makefile's `setup` (what CI builds and tests), the
build arguments `make images` builds them with here (local bases, the CPU trainer) leaving the production
defaults as they are, and the layers that keep a rebuild after a source change fast: the dependencies
installed from pyproject.toml's lists before any source is copied, memfit itself last with --no-deps."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from dockerfile_parse import DockerfileParser
from packaging.requirements import Requirement

from memfit.api.runtime import IMAGE_RUNTIME
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
    steps: list[tuple[str, str]] = field(default_factory=list)
    """Every instruction after FROM, in order: (kind, value with its whitespace collapsed)."""
    workdir: str | None = None
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
            continue
        if kind != "COMMENT":
            current.steps.append((kind, " ".join(value.split())))
        if kind == "ARG" and "=" in value:
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
        elif kind == "WORKDIR":
            current.workdir = value
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


def pip_install_args(run: str) -> list[list[str]]:
    """The arguments of every `pip install` in one RUN step."""
    installs = []
    for command in run.split("&&"):
        words = shlex.split(command)
        if "pip" in words and "install" in words:
            installs.append(words[words.index("install") + 1 :])
    return installs


def pip_installs(stage: Stage) -> list[list[str]]:
    """The arguments of every `python -m pip install` in the stage's RUN steps."""
    return [install for run in stage.runs for install in pip_install_args(run)]


def dependency_install(stage: Stage) -> str:
    """The one RUN step that installs the image's dependencies: from the requirements file."""
    (run,) = [run for run in stage.runs if any("requirements.txt" in args for args in pip_install_args(run))]
    return run


def is_source_copy(value: str) -> bool:
    """A COPY from the build context (not --from another stage)."""
    return not any(word.startswith("--from=") for word in value.split())


REQUIREMENTS = "requirements"
"""The stage that extracts the images' requirements files from pyproject.toml."""


def pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


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
    build = dependency_install(dockerfile["trainer"])
    assert "DS_BUILD_SHM_COMM=1" in build and "DS_ACCELERATOR=${TRAINER_VARIANT}" in build
    assert "'deepspeed_shm_comm'" in build and "g++" in " ".join(dockerfile["trainer"].runs)


def test_make_images_builds_the_operator_and_the_cpu_trainer_on_the_local_base() -> None:
    makefile = (ROOT / "Makefile").read_text()
    recipe = re.split(r"\nimages:[^\n]*\n", makefile, maxsplit=1)[1].split("\n\n", 1)[0]
    assert "images/base.sh $(BASE_IMAGE)" in recipe and "--target operator" in recipe
    assert "--build-arg TRAINER_VARIANT=cpu" in recipe and "TORCH_VERSION=$(patsubst torch==%,%,$(TORCH))+cpu" in recipe
    for base in ("OPERATOR_BASE", "TRAINER_BASE"):
        assert f"--build-arg {base}=$(BASE_IMAGE)" in makefile


def make_recipe(target: str) -> str:
    """The recipe of a Makefile target (up to its first empty line): after its rule line, not after a line that
    sets a variable for it."""
    makefile = (ROOT / "Makefile").read_text()
    return re.split(rf"\n{re.escape(target)}:[^=\n]*\n(?=\t)", makefile, maxsplit=1)[1].split("\n\n", 1)[0]


def test_make_image_cuda_builds_the_cuda_trainer_from_pypi_with_the_torch_pin() -> None:
    """`make image-cuda`: the production variant (TRAINER_VARIANT=cuda) of the Makefile's TORCH pin as it is (torch's
    CUDA build, from PyPI), on the local base, nvcc from PyPI's NVIDIA wheels in the folder of the ones torch pulls.
    Without the wheel folder and its find-links (torch's CPU build of the same version would satisfy torch==X),
    and checked by images/check-cuda-trainer.sh once built, so a broken image fails the target."""
    recipe = make_recipe("image-cuda")
    assert "images/base.sh $(BASE_IMAGE)" in recipe and "--target trainer" in recipe
    assert "--build-arg TRAINER_VARIANT=cuda" in recipe
    assert "--build-arg TORCH_VERSION=$(patsubst torch==%,%,$(TORCH)) " in recipe  # no +cpu, no other pin
    assert "--build-arg TORCH_INDEX=$(TORCH_CUDA_INDEX)" in recipe
    assert makefile_variable("TORCH_CUDA_INDEX") == "https://pypi.org/simple"
    assert "--build-arg TRAINER_BASE=$(BASE_IMAGE)" in recipe and "--build-arg OPERATOR_BASE=$(BASE_IMAGE)" in recipe
    assert "$(PODMAN_BUILD)" not in recipe and "$(WHEELS)" not in recipe and "find-links" not in recipe
    assert "--build-arg CUDA_TOOLKIT='$(CUDA_TOOLKIT)'" in recipe
    assert "--build-arg CUDA_HOME=$(CUDA_TOOLKIT_HOME)" in recipe
    assert recipe.splitlines()[-1].strip() == "images/check-cuda-trainer.sh $(CUDA_TRAINER_IMAGE)"
    script = ROOT / "images" / "check-cuda-trainer.sh"
    assert script.stat().st_mode & 0o111
    # The toolkit's wheels go where torch's runtime wheels go: the image's virtual environment, its Python, the
    # nvidia/cuXX folder of the toolkit's CUDA major.
    toolkit = Requirement(makefile_variable("CUDA_TOOLKIT"))
    assert toolkit.name == "cuda-toolkit" and {"nvcc", "cccl"} <= toolkit.extras
    (pin,) = toolkit.specifier
    assert pin.operator == "=="
    python = stages()[GLOBAL].args["PYTHON_VERSION"]
    assert makefile_variable("CUDA_TOOLKIT_HOME") == (
        f"/opt/memfit/lib/python{python}/site-packages/nvidia/cu{pin.version.split('.')[0]}"
    )


def test_the_torch_pin_is_one_the_trainer_extra_admits() -> None:
    """Both trainer variants install the Makefile's torch first, then pyproject.toml's trainer extra: an extra that
    did not admit that version would make the dependency step replace it (with PyPI's newest torch, a CUDA build
    even in the CPU image) instead of failing."""
    version = makefile_variable("TORCH").removeprefix("torch==")
    (torch,) = [Requirement(dep) for dep in pyproject()["project"]["optional-dependencies"]["trainer"]
                if Requirement(dep).name == "torch"]  # fmt: skip
    assert torch.specifier.contains(version) and torch.specifier.contains(version + "+cpu")


def test_the_cuda_stage_installs_no_toolkit_on_the_production_base(dockerfile: dict[str, Stage]) -> None:
    """By default (the nvidia/cuda devel base) nvcc is the base's: CUDA_TOOLKIT is empty, its step does nothing, and
    CUDA_HOME and the linker's stubs are where that image has them."""
    stage = dockerfile["trainer-cuda"]
    assert stage.args["CUDA_TOOLKIT"] == '""' and stage.args["CUDA_HOME"] == "/usr/local/cuda"
    env = stage.env.split()
    assert "CUDA_HOME=${CUDA_HOME}" in env and "LIBRARY_PATH=${CUDA_HOME}/lib64/stubs" in env
    (run,) = stage.runs
    assert run.startswith('[ -z "${CUDA_TOOLKIT}" ] ||') and 'pip install --no-cache-dir "${CUDA_TOOLKIT}"' in run
    assert "/opt/memfit" in run and "lib64/stubs" not in run  # the stubs are lib/stubs through the lib64 link
    assert "CUDA_TOOLKIT" not in " ".join(dockerfile["trainer-cpu"].runs + dockerfile["trainer-cpu"].env.split())


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
    looks in both folders (and finds nothing in the one an image lacks). From the requirements stage an image
    takes its own requirements file only."""
    copies = [" ".join(words) for words in dockerfile[target].copies]
    sources = {
        source for copy in copies if is_source_copy(copy) for source in copy.split()[:-1] if not source.startswith("--")
    }
    assert sources == {"pyproject.toml", "README.md", "memfit", target}
    assert [copy for copy in copies if not is_source_copy(copy)] == [
        f"--from={REQUIREMENTS} /requirements/{target}.txt requirements.txt"
    ]
    find = pyproject()["tool"]["setuptools"]["packages"]["find"]
    assert set(find["where"]) == {".", "operator", "trainer"}


@pytest.mark.parametrize("target", ["operator", "trainer"])
def test_dependencies_are_a_layer_before_any_source(dockerfile: dict[str, Stage], target: str) -> None:
    """Layer caching: everything up to the dependency install depends on the base, the build arguments and
    the image's requirements file only (COPY --from is cached by its content), so a change of the sources,
    README.md or pyproject.toml's other tables reruns only the steps after the first source COPY, and those
    are memfit's own install, --no-deps (its dependencies are the layer above), and pip check."""
    steps = dockerfile[target].steps
    first_source = next(i for i, (kind, value) in enumerate(steps) if kind == "COPY" and is_source_copy(value))
    before, after = steps[:first_source], steps[first_source:]
    assert [value for kind, value in before if kind == "COPY"] == [
        f"--from={REQUIREMENTS} /requirements/{target}.txt requirements.txt"
    ]
    assert dependency_install(dockerfile[target]) in [value for kind, value in before if kind == "RUN"]
    assert pip_install_args(dependency_install(dockerfile[target]))[0][-2:] == ["-r", "requirements.txt"]
    (package,) = [value for kind, value in after if kind == "RUN"]
    assert pip_install_args(package) == [["--no-deps", "--no-build-isolation", "."]]
    assert package.endswith("&& python -m pip check")  # the build fails if a dependency is unmet
    assert {kind for kind, _ in after} <= {"COPY", "RUN", "USER", "ENTRYPOINT", "CMD"}


def test_requirements_stage_extracts_pyprojects_dependency_lists(dockerfile: dict[str, Stage], tmp_path: Path) -> None:
    """The requirements stage's own script, run on pyproject.toml: each image's file is project.dependencies
    plus its extra (what `pip install '.[operator]'` / `'.[trainer]'` would install), and nothing else of
    the repository reaches the stage."""
    stage = dockerfile[REQUIREMENTS]
    assert base_image(dockerfile, REQUIREMENTS) == base_image(dockerfile, "operator")  # a Python with tomllib
    assert stage.workdir == "/requirements" and stage.copies == [["pyproject.toml", "./"]]
    (run,) = stage.runs
    words = shlex.split(run)
    assert words[:2] == ["python", "-c"] and len(words) == 3
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    subprocess.run([sys.executable, "-c", words[2]], cwd=tmp_path, check=True)
    project = pyproject()["project"]
    for target in ("operator", "trainer"):
        lines = (tmp_path / f"{target}.txt").read_text().splitlines()
        assert len(lines) == len(set(lines))
        assert set(lines) == set(project["dependencies"]) | set(project["optional-dependencies"][target])


def test_operator_image_has_no_torch(dockerfile: dict[str, Stage]) -> None:
    stage = dockerfile["operator"]
    assert not any(
        "torch" in run or "[trainer" in run or "deepspeed" in run or "trainer.txt" in run for run in stage.runs
    )
    assert pip_installs(stage)[1:] == [["-r", "requirements.txt"], ["--no-deps", "--no-build-isolation", "."]]
    project = pyproject()["project"]
    dependencies = project["dependencies"] + project["optional-dependencies"]["operator"]
    assert not any(re.match(r"(torch|deepspeed|bitsandbytes)\b", dep) for dep in dependencies)


def test_trainer_installs_like_the_makefile(dockerfile: dict[str, Stage]) -> None:
    """Makefile setup: pip/setuptools/wheel upgraded, "$(TORCH)" first, then memfit --no-build-isolation (here
    its dependencies, then memfit itself)."""
    stage = dockerfile["trainer"]
    installs = pip_installs(stage)
    makefile = (ROOT / "Makefile").read_text()
    assert "pip install --quiet --upgrade pip setuptools wheel" in makefile
    assert installs[0] == ["--upgrade", "pip", "setuptools", "wheel"]
    torch_pin = makefile_variable("TORCH")  # torch==X.Y.Z
    assert installs[1][0] == "torch==${TORCH_VERSION}" and f"torch=={stage.args['TORCH_VERSION']}" == torch_pin
    assert "--no-build-isolation -e '.[operator,trainer,dev]'" in makefile
    assert installs[2:] == [
        ["--no-build-isolation", "-r", "requirements.txt"],
        ["--no-build-isolation", "${KERNEL_PACKAGES}"],  # none by default (test_kernel_packages_...)
        ["--no-deps", "--no-build-isolation", "."],
    ]
    assert any("-m venv /opt/memfit" in run for run in stage.runs) and "PATH=/opt/memfit/bin:$PATH" in stage.env


def test_trainer_prebuilds_deepspeed_ops_for_its_cuda(dockerfile: dict[str, Stage]) -> None:
    stage = dockerfile["trainer"]
    build = dependency_install(stage)  # the dependency layer: a source change does not recompile the ops
    for op in ("DS_BUILD_CPU_ADAM=1", "DS_BUILD_FUSED_ADAM=1", "DS_BUILD_AIO=1", "TORCH_CUDA_ARCH_LIST="):
        assert op in build
    assert "installed_ops" in build  # the build fails if an op was not compiled
    # for the variant's accelerator: a builder sees no GPU, and DeepSpeed would build its CPU ops otherwise
    (install,) = [command for command in build.split("&&") if "requirements.txt" in command]
    assert "DS_ACCELERATOR=${TRAINER_VARIANT} python -m pip install" in install
    assert "accelerator_name == '${TRAINER_VARIANT}'" in build
    cuda = re.search(r"nvidia/cuda:(\d+)\.(\d+)", base_image(dockerfile, "trainer"))
    index = re.search(r"/whl/cu(\d+)$", stage.args["TORCH_INDEX"])
    assert cuda and index and index.group(1) == cuda.group(1) + cuda.group(2), "torch's CUDA differs from nvcc's"
    assert any("libaio-dev" in run for run in stage.runs)  # async I/O (NVMe offload) links against it
    assert "TORCH_EXTENSIONS_DIR=/tmp/" in stage.env  # writable by the non-root user (the pod mounts /tmp)


def test_kernel_packages_the_image_carries_are_what_the_chart_and_the_planner_say(
    dockerfile: dict[str, Stage],
) -> None:
    """The trainer image installs no kernel package beyond its requirements unless built with KERNEL_PACKAGES;
    the chart's default trainer.kernelPackages and the planner's image runtime say the same, so the operator's
    default plans use only kernels the default image has."""
    stage = dockerfile["trainer"]
    assert stage.args["KERNEL_PACKAGES"] == '""'
    (kernel_step,) = [run for run in stage.runs if "${KERNEL_PACKAGES}" in run]
    assert kernel_step.startswith('[ -z "${KERNEL_PACKAGES}" ] ||')
    values = yaml.safe_load((ROOT / "charts" / "memfit" / "values.yaml").read_text())
    assert values["trainer"]["kernelPackages"] == sorted(IMAGE_RUNTIME.packages) == []
    requirements = pyproject()["project"]["optional-dependencies"]["trainer"]
    assert not [dep for dep in requirements if re.match(r"(flash-attn|flash-linear-attention)\b", dep)]
