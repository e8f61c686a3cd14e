# Developer entry points. `make test` is what CI runs (.ci/run); `make demo` is the main job on a machine
# without a cluster. Both build the virtual environment first, from nothing but Python and the registries.

VENV ?= .venv
PY := $(VENV)/bin/python
# torch 2.13.0 is pinned for the CPU: on these machines pip takes its CPU wheel from local disk; a range
# would pull a multi-GB CUDA build. DeepSpeed builds its sdist against that torch (no build isolation).
TORCH ?= torch==2.13.0

# Debian's promtool checks the metrics the trainer exports (tests/trainer/test_metrics.py).
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
# A real kube-apiserver + etcd for tests/k8s (the envtest convention): KUBEBUILDER_ASSETS if set, else
# hack/envtest-assets builds and caches them from Debian's packages (minutes the first time).
ENVTEST ?= hack/envtest-assets
# DeepSpeed compiles its CPU ops on first use (minutes): keep them across runs, one directory per virtual
# environment (ninja rebuilds an op whose include paths changed, so two checkouts sharing one directory would
# rebuild each other's ops, and wait on each other's locks, on every alternation).
export TORCH_EXTENSIONS_DIR ?= $(HOME)/.cache/memfit/torch_extensions/$(shell printf %s "$(abspath $(VENV))" | sha256sum | cut -c1-12)

.PHONY: setup tools test test-fast demo profiles crds dashboards lint bench image-tools images images-load e2e

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip setuptools wheel
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet --no-build-isolation -e '.[operator,trainer,dev]'
	touch $@

tools:
	@command -v promtool >/dev/null || { $(SUDO) apt-get update -qq && \
		$(SUDO) apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }

# One pytest worker per core (pytest-xdist; TEST_WORKERS=1 runs in one process), each test module on one worker
# (its module fixtures, an API server or a shared run, are built once), the longest modules first: the order of
# tests/conftest.py, which --no-loadscope-reorder keeps (xdist would sort modules by test count). `python -m
# tests.durations build/test-report.xml` refreshes the modules' times from the report written here.
# --durations: CI's log says where its minutes go (the suite must leave `make e2e` room in CI's 60).
TEST_WORKERS ?= auto
PYTEST = OMP_NUM_THREADS=1 $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
test: setup tools
	assets="$$($(ENVTEST))" && KUBEBUILDER_ASSETS="$$assets" $(PYTEST) --durations=30 --junitxml=build/test-report.xml

# The inner loop: no API server, no torchrun, nothing over ~1 s (the markers are in pyproject.toml); under a
# minute on 2 cores. promtool is still needed (tests/monitoring, tests/trainer/test_metrics.py).
test-fast: setup tools
	$(PYTEST) -m "not k8s and not distributed and not slow"

demo: setup
	$(VENV)/bin/memfit run examples/tiny/job.yaml --local

# The profiles of the stored model configs (tests/test_stored_profiles.py fails when they drift).
profiles: setup
	for config in memfit/catalog/configs/*.json; do \
		name=$$(basename $$config .json); echo "profiling $$name"; \
		PYTHONPATH=trainer $(PY) -m memfit_trainer.profile $$config --activations -o json > memfit/catalog/profiles/$$name.tmp \
			&& mv memfit/catalog/profiles/$$name.tmp memfit/catalog/profiles/$$name.json \
			|| { rm -f memfit/catalog/profiles/$$name.tmp; exit 1; }; \
	done

crds: setup
	$(PY) -c "from memfit.api.crd import ALL_CRD_FILES, crd_yaml; [open(f'crds/{n}', 'w').write(crd_yaml(g())) for n, g in ALL_CRD_FILES.items()]"
	cp crds/*.yaml charts/memfit/crds/

# The Grafana dashboards of the chart, generated (tests/monitoring fails when they are stale).
dashboards: setup
	$(PY) charts/tools/dashboards.py

# Style (ruff), types (mypy: strict everywhere) and the layers (import-linter: the core
# imports neither cluster nor torch code, the operator and the trainer never import each other).
LINTED := memfit operator trainer calibration tests bench charts e2e
lint: setup
	$(VENV)/bin/ruff check $(LINTED)
	$(VENV)/bin/ruff format --check $(LINTED)
	$(VENV)/bin/mypy
	PYTHONPATH=operator:trainer $(VENV)/bin/lint-imports

bench: setup
	$(PY) bench/planner_speed.py
	PYTHONPATH=. $(PY) bench/estimate_vs_trace.py | tail -n 8
	DS_ACCELERATOR=cpu $(PY) bench/trainer_vs_deepspeed.py
	$(PY) bench/verify_speed.py
	assets="$$($(ENVTEST))" && KUBEBUILDER_ASSETS="$$assets" $(PY) bench/operator_scale.py --jobs 500

# The operator image and a CPU trainer built with podman from the Dockerfile, on a machine that pulls from no
# container registry: their base is a Debian made here from Debian's packages (images/base.sh, cached).
PODMAN ?= podman
images images-load: export CONTAINERS_CONF ?= $(CURDIR)/images/containers.conf
IMAGE_TAG ?= dev
BASE_IMAGE ?= localhost/memfit-base-debian:bookworm
DEBIAN_MIRROR ?= http://deb.debian.org/debian
OPERATOR_IMAGE ?= localhost/memfit-operator:$(IMAGE_TAG)
TRAINER_IMAGE ?= localhost/memfit-trainer:$(IMAGE_TAG)-cpu
# pip inside a build step uses this machine's CA bundle (its registries may be reached through a re-signing
# proxy) and its folder of wheels (PIP_FIND_LINKS: torch's CPU build), mounted for the build only: nothing
# of this machine lands in an image.
CA_BUNDLE ?= /etc/ssl/certs/ca-certificates.crt
WHEELS ?= $(PIP_FIND_LINKS)
BUILD_PIP_CONF := $(CURDIR)/build/images-pip.conf
# Torch's CPU build: from the wheel folder (PyPI has only the CUDA build); https://download.pytorch.org/whl/cpu
# where that is reachable.
TORCH_CPU_INDEX ?= https://pypi.org/simple
PODMAN_BUILD = $(PODMAN) build --network host --build-arg OPERATOR_BASE=$(BASE_IMAGE) \
	--build-arg TRAINER_BASE=$(BASE_IMAGE) -v $(CA_BUNDLE):/run/build/ca.crt:ro -v $(BUILD_PIP_CONF):/etc/pip.conf:ro \
	$(if $(WHEELS),-v $(WHEELS):/run/build/wheels:ro)
# The node's containerd (hack/node up), in the namespace the kubelet's images live in.
CONTAINERD_SOCK ?= /run/containerd/containerd.sock

# podman from Debian where it is missing, with runc: images/containers.conf picks runc (crun refuses the hybrid
# cgroups of machines like CI's) and cgroupfs.
image-tools:
	@command -v $(PODMAN) >/dev/null && command -v runc >/dev/null || { $(SUDO) apt-get update -qq && \
		$(SUDO) apt-get install -y -qq --no-install-recommends podman runc >/dev/null; }

images: image-tools
	images/base.sh $(BASE_IMAGE) $(DEBIAN_MIRROR)
	mkdir -p build && printf '[global]\ncert = /run/build/ca.crt\n$(if $(WHEELS),find-links = /run/build/wheels\n)' > $(BUILD_PIP_CONF)
	$(PODMAN_BUILD) --target operator -t $(OPERATOR_IMAGE) .
	$(PODMAN_BUILD) --target trainer --build-arg TRAINER_VARIANT=cpu --build-arg TORCH_VERSION=$(patsubst torch==%,%,$(TORCH))+cpu \
		--build-arg TORCH_INDEX=$(TORCH_CPU_INDEX) -t $(TRAINER_IMAGE) .
	rm -f $(BUILD_PIP_CONF)

# The production trainer image (TRAINER_VARIANT=cuda) from bases this machine can pull: the Debian base above,
# torch's CUDA build of the TORCH pin from PyPI (PyPI's Linux wheel is it; it pulls NVIDIA's runtime wheels),
# and nvcc for DeepSpeed's CUDA ops from PyPI's NVIDIA wheels: CUDA_TOOLKIT is the cuda-toolkit pin of that
# torch wheel's metadata with the nvcc and cccl extras, installed into the folder torch's wheels use
# (CUDA_TOOLKIT_HOME, cu13: torch 2.13's CUDA 13.0). No wheel folder and no find-links: its CPU build of the
# same version would satisfy torch==X. images/check-cuda-trainer.sh then starts the image without a GPU and
# checks it. docs/cuda-trainer-image.md.
.PHONY: image-cuda
image-cuda: export CONTAINERS_CONF ?= $(CURDIR)/images/containers.conf
CUDA_TRAINER_IMAGE ?= localhost/memfit-trainer:$(IMAGE_TAG)-cuda
TORCH_CUDA_INDEX ?= https://pypi.org/simple
CUDA_TOOLKIT ?= cuda-toolkit[nvcc,cccl]==13.0.3
CUDA_TOOLKIT_HOME ?= /opt/memfit/lib/python3.11/site-packages/nvidia/cu13
CUDA_BUILD_PIP_CONF := $(CURDIR)/build/image-cuda-pip.conf

image-cuda: image-tools
	images/base.sh $(BASE_IMAGE) $(DEBIAN_MIRROR)
	mkdir -p build && printf '[global]\ncert = /run/build/ca.crt\n' > $(CUDA_BUILD_PIP_CONF)
	$(PODMAN) build --network host --build-arg OPERATOR_BASE=$(BASE_IMAGE) --build-arg TRAINER_BASE=$(BASE_IMAGE) \
		-v $(CA_BUNDLE):/run/build/ca.crt:ro -v $(CUDA_BUILD_PIP_CONF):/etc/pip.conf:ro \
		--target trainer --build-arg TRAINER_VARIANT=cuda --build-arg TORCH_VERSION=$(patsubst torch==%,%,$(TORCH)) \
		--build-arg TORCH_INDEX=$(TORCH_CUDA_INDEX) --build-arg CUDA_TOOLKIT='$(CUDA_TOOLKIT)' \
		--build-arg CUDA_HOME=$(CUDA_TOOLKIT_HOME) -t $(CUDA_TRAINER_IMAGE) . \
		|| { rm -f $(CUDA_BUILD_PIP_CONF); exit 1; }
	rm -f $(CUDA_BUILD_PIP_CONF)
	images/check-cuda-trainer.sh $(CUDA_TRAINER_IMAGE)

images-load:
	@ctr --address $(CONTAINERD_SOCK) version >/dev/null 2>&1 || \
		{ echo "images-load: no containerd at $(CONTAINERD_SOCK): start the node first (hack/node up)"; exit 1; }
	for image in $(OPERATOR_IMAGE) $(TRAINER_IMAGE); do \
		$(PODMAN) save --format docker-archive $$image | ctr --address $(CONTAINERD_SOCK) -n k8s.io images import - || exit 1; \
	done

# The whole product on a real single-node cluster (hack/node: root, containerd): build the node and the images
# (both cached), start the node and load the images, then e2e/ installs the chart and runs jobs with real pods.
# The node is stopped afterwards, whatever the loading or the tests said.
NODE ?= hack/node
e2e: setup
	$(NODE) build
	$(MAKE) images
	$(NODE) down >/dev/null 2>&1 || true   # a node left up by an earlier run: `up` starts a fresh one
	$(NODE) up
	$(MAKE) images-load || { $(NODE) down; exit 1; }
	OMP_NUM_THREADS=1 $(PY) -m pytest e2e -p no:cacheprovider --durations=0; status=$$?; $(NODE) down; exit $$status
