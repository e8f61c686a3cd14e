# syntax=docker/dockerfile:1.7
# Two images from one file:
#   docker build --target operator -t memfit-operator .   slim: the core and kopf, no torch
#   docker build --target trainer  -t memfit-trainer  .   CUDA, torch, DeepSpeed (ops prebuilt), peft, bitsandbytes
# Both run as an unprivileged user. The install steps are the ones CI runs (see the Makefile).

ARG PYTHON_VERSION=3.11
ARG CUDA_IMAGE=nvidia/cuda:12.4.1-cudnn-devel-ubuntu22.04

# --- operator ---------------------------------------------------------------------------------------
FROM python:${PYTHON_VERSION}-slim AS operator
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY operator ./operator
# The trainer package comes along for its config contract (pydantic only); torch is not installed.
COPY trainer ./trainer
RUN pip install '.[operator]' \
 && useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin memfit
USER 10001
ENTRYPOINT ["memfit"]
CMD ["operator"]

# --- trainer ----------------------------------------------------------------------------------------
FROM ${CUDA_IMAGE} AS trainer
ARG PYTHON_VERSION
ARG TORCH_VERSION=2.5.1
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu124
ENV DEBIAN_FRONTEND=noninteractive PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    TORCH_EXTENSIONS_DIR=/opt/torch_extensions HF_HOME=/tmp/hf
RUN apt-get update \
 && apt-get install -y --no-install-recommends python${PYTHON_VERSION} python${PYTHON_VERSION}-dev python3-pip libaio-dev ninja-build \
 && rm -rf /var/lib/apt/lists/* \
 && ln -sf /usr/bin/python${PYTHON_VERSION} /usr/local/bin/python
WORKDIR /app
RUN python -m pip install --upgrade pip setuptools wheel \
 && python -m pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"
COPY pyproject.toml README.md ./
COPY operator ./operator
COPY trainer ./trainer
# DeepSpeed's ops compiled at build time (CPU Adam for offload, fused Adam, async I/O for NVMe), so a pod
# never spends minutes compiling before its first step.
RUN DS_BUILD_CPU_ADAM=1 DS_BUILD_FUSED_ADAM=1 DS_BUILD_AIO=1 TORCH_CUDA_ARCH_LIST="8.0;8.6;8.9;9.0" \
    python -m pip install --no-build-isolation '.[trainer]' \
 && useradd --uid 10001 --create-home --shell /usr/sbin/nologin memfit
USER 10001
ENTRYPOINT ["memfit-train"]
