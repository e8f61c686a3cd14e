# Developer entry points. `make test` is what CI runs (.ci/run); `make demo` is the main job on a machine
# without a cluster. Both build the virtual environment first, from nothing but Python and the registries.

VENV ?= .venv
PY := $(VENV)/bin/python
# torch 2.13.0 is pinned for the CPU: on these machines pip takes its CPU wheel from local disk; a range
# would pull a multi-GB CUDA build. DeepSpeed builds its sdist against that torch (no build isolation).
TORCH ?= torch==2.13.0

.PHONY: setup test demo crds lint bench

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip setuptools wheel
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet --no-build-isolation -e '.[operator,trainer,dev]'
	touch $@

test: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest

demo: setup
	$(VENV)/bin/memfit plan examples/llama-3.1-8b-lora.yaml --inventory examples/inventory.yaml

crds: setup
	$(PY) -c "from memfit.api.crd import CRD_FILES, crd_yaml; [open(f'crds/{n}', 'w').write(crd_yaml(g())) for n, g in CRD_FILES.items()]"

lint: setup
	$(VENV)/bin/ruff check operator trainer tests bench

bench: setup
	$(PY) bench/planner_speed.py
	$(PY) bench/estimate_vs_trace.py | tail -n 8
