# syntax=docker/dockerfile:1.7
# Two images from one file:
#   docker build --target operator -t memfit-operator .   slim: the core and kopf, no torch
#   docker build --target trainer  -t memfit-trainer  .   CUDA, torch, DeepSpeed (ops prebuilt), peft, bitsandbytes
# The build arguments' defaults build those production images. OPERATOR_BASE and TRAINER_BASE replace the
# registry bases (any Debian or Ubuntu with Python; `make images` uses one made from Debian's packages), and
# TRAINER_VARIANT=cpu builds a trainer for machines without GPUs (with TORCH_VERSION=2.13.0+cpu, torch's CPU
# build): DeepSpeed's CPU accelerator and its ops prebuilt. The CUDA trainer builds on a base without CUDA too
# (`make image-cuda`: the local Debian, torch's CUDA build from PyPI, CUDA_TOOLKIT: nvcc from PyPI's NVIDIA
# wheels; docs/cuda-trainer-image.md).
# Both run as the unprivileged uid 10001 (the chart's Deployment and the operator's trainer pods run as it).
# The install steps are the Makefile's `setup` steps (what CI runs): a virtual environment, pip, setuptools
# and wheel upgraded, torch first at the Makefile's version, then memfit's dependencies without build
# isolation so DeepSpeed builds against that torch, then memfit. tests/chart/test_dockerfile.py holds the
# two together.
# Each image copies the core (memfit/) and its own package only: the operator and the trainer share nothing
# else (their contract is memfit.contract), and pyproject.toml's package search skips the absent folder.
# Layers, for fast rebuilds: the dependencies are installed before any source is copied, from a requirements
# file per image that the `requirements` stage extracts from pyproject.toml (project.dependencies plus the
# image's extra). COPY --from is cached by content, so only a change of that list reinstalls them (in the
# trainer, recompiles DeepSpeed's ops); a change of the sources, README.md or pyproject.toml's other tables
# reruns only the last step, `pip install --no-deps .` of memfit itself. The `requirements` stage runs on
# OPERATOR_BASE (it needs a Python with tomllib, which the CUDA base lacks before its apt step).

ARG PYTHON_VERSION=3.11
ARG OPERATOR_BASE=python:${PYTHON_VERSION}-slim
# CUDA devel image: nvcc compiles DeepSpeed's ops at build time. Its CUDA version is the one of the
# PyTorch wheel index of the trainer stage (cu128 = 12.8).
ARG TRAINER_BASE=nvidia/cuda:12.8.1-cudnn-devel-ubuntu22.04
ARG TRAINER_VARIANT=cuda

# --- requirements -----------------------------------------------------------------------------------
# operator.txt and trainer.txt: project.dependencies plus the image's optional dependencies, in
# pyproject.toml's order, each once. Only these files reach the images.
FROM ${OPERATOR_BASE} AS requirements
WORKDIR /requirements
COPY pyproject.toml ./
RUN python -c "import pathlib, tomllib; project = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
      write = lambda extra: pathlib.Path(extra + '.txt').write_text('\n'.join(dict.fromkeys( \
        project['dependencies'] + project['optional-dependencies'][extra])) + '\n'); \
      write('operator'); write('trainer')"

# --- operator ---------------------------------------------------------------------------------------
FROM ${OPERATOR_BASE} AS operator
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/memfit PATH=/opt/memfit/bin:$PATH
RUN python -m venv /opt/memfit \
 && python -m pip install --upgrade pip setuptools wheel \
 && useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin memfit
WORKDIR /app
COPY --from=requirements /requirements/operator.txt requirements.txt
RUN python -m pip install -r requirements.txt
# memfit itself, without its dependencies (the layer above; pip check fails the build if one is unmet).
COPY pyproject.toml README.md ./
COPY memfit ./memfit
COPY operator ./operator
RUN python -m pip install --no-deps --no-build-isolation . \
 && python -m pip check
USER 10001:10001
ENTRYPOINT ["memfit"]
CMD ["operator"]

# --- trainer ----------------------------------------------------------------------------------------
# One stage per TRAINER_VARIANT (DeepSpeed's accelerator names), then the steps they share.
FROM ${TRAINER_BASE} AS trainer-cuda
ARG PYTHON_VERSION
# What DeepSpeed's CUDA ops compile with (nvcc, the CUDA headers) and link against (libcudart, a libcuda stub):
# by default the devel base's toolkit, where nvidia/cuda's images have it. On a base without CUDA, CUDA_TOOLKIT
# names PyPI's NVIDIA wheels of the CUDA torch's wheel is built for (its own cuda-toolkit pin, extras nvcc and
# cccl): they go into the virtual environment's nvidia/cuXX folder, beside the runtime wheels torch pulls there,
# and CUDA_HOME names that folder; what a toolkit has and the wheels lack is added: lib64, the unversioned
# libcudart.so the linker looks for, and libcuda.so in lib64/stubs, an empty linker script (the async I/O op
# links -lcuda but calls no driver function; a pod gets the driver from its node).
ARG CUDA_TOOLKIT=""
ARG CUDA_HOME=/usr/local/cuda
ENV CUDA_HOME=${CUDA_HOME} LIBRARY_PATH=${CUDA_HOME}/lib64/stubs
RUN [ -z "${CUDA_TOOLKIT}" ] || { python${PYTHON_VERSION} -m venv /opt/memfit \
 && /opt/memfit/bin/python -m pip install --no-cache-dir "${CUDA_TOOLKIT}" \
 && cd "${CUDA_HOME}" && ln -s lib lib64 && ln -s "$(cd lib && echo libcudart.so.*)" lib/libcudart.so \
 && mkdir lib/stubs && echo '/* libcuda.so: no driver here (a build links against this stub) */' > lib/stubs/libcuda.so; }
FROM ${TRAINER_BASE} AS trainer-cpu
# Without a GPU DeepSpeed falls back to the CPU with a warning; named, the build compiles the CPU ops.
ENV DS_ACCELERATOR=cpu
FROM trainer-${TRAINER_VARIANT} AS trainer
ARG PYTHON_VERSION
ARG TRAINER_VARIANT
# The Makefile's TORCH pin; the CUDA build of the same version.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
ENV DEBIAN_FRONTEND=noninteractive PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/memfit PATH=/opt/memfit/bin:$PATH \
    TORCH_EXTENSIONS_DIR=/tmp/torch_extensions HF_HOME=/tmp/hf
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      python${PYTHON_VERSION} python${PYTHON_VERSION}-dev python${PYTHON_VERSION}-venv libaio-dev ninja-build git g++ \
 && rm -rf /var/lib/apt/lists/* \
 && python${PYTHON_VERSION} -m venv /opt/memfit
WORKDIR /app
RUN python -m pip install --upgrade pip setuptools wheel \
 && python -m pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"
COPY --from=requirements /requirements/trainer.txt requirements.txt
# The dependencies, without build isolation so DeepSpeed builds against the torch above, with DeepSpeed's ops
# compiled at build time (CPU Adam for offload, fused Adam, async I/O for NVMe; on the CPU accelerator also
# its shared-memory collectives, an op CUDA's builders do not have), so a pod never spends minutes compiling
# before its first step. No GPU is needed to build them: the architectures are named (A100, A10/A40/3090,
# L4/L40/4090, H100/H200). g++ above: the CUDA devel image has it, a plain base not. DS_ACCELERATOR names the
# variant for the build: a builder has no GPU, and DeepSpeed would detect its CPU accelerator and build CPU
# ops, which a pod on GPUs ignores (it compiles them again, minutes, before its first step); a pod detects.
RUN DS_BUILD_CPU_ADAM=1 DS_BUILD_FUSED_ADAM=1 DS_BUILD_AIO=1 DS_BUILD_SHM_COMM=1 TORCH_CUDA_ARCH_LIST="8.0;8.6;8.9;9.0" \
    DS_ACCELERATOR=${TRAINER_VARIANT} python -m pip install --no-build-isolation -r requirements.txt \
 && DS_ACCELERATOR=${TRAINER_VARIANT} python -c "from deepspeed.git_version_info import installed_ops as ops, accelerator_name; \
      built = ('cpu_adam', 'fused_adam', 'async_io') + (('deepspeed_shm_comm',) if '${TRAINER_VARIANT}' == 'cpu' else ()); \
      assert accelerator_name == '${TRAINER_VARIANT}' and all(ops[op] for op in built), (accelerator_name, ops)" \
 && useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin memfit
# Kernel packages beyond torch (memfit.api.runtime), none by default: flash-attn compiles for hours with the
# devel base's nvcc. Built with e.g. KERNEL_PACKAGES="flash-attn>=2.7,<3", the chart's trainer.kernelPackages
# must name them, so that the planner plans their kernels (it plans only kernels the trainer has).
ARG KERNEL_PACKAGES=""
RUN [ -z "${KERNEL_PACKAGES}" ] \
 || MAX_JOBS=4 TORCH_CUDA_ARCH_LIST="8.0;8.6;8.9;9.0" python -m pip install --no-build-isolation ${KERNEL_PACKAGES}
# memfit itself, without its dependencies (the layer above; pip check fails the build if one is unmet).
COPY pyproject.toml README.md ./
COPY memfit ./memfit
COPY trainer ./trainer
RUN python -m pip install --no-deps --no-build-isolation . \
 && python -m pip check
USER 10001:10001
# The operator's pods run `torchrun -m memfit_trainer.main` (on PATH from the virtual environment).
ENTRYPOINT ["memfit-train"]
