#!/bin/sh
# Starts the CUDA trainer image (`make image-cuda`) on a machine without a GPU, as podman containers given no
# device, and checks what a pod does before it needs one; exits non-zero when a check fails.
#   images/check-cuda-trainer.sh IMAGE     (run from the repository root: examples/tiny is mounted as the job)
# 1. imports: torch (its CUDA build, with the nvcc the ops were built with), every library the trainer imports,
#    and every memfit_trainer module, with DS_ACCELERATOR unset as on a GPU pool's pods (DeepSpeed falls back
#    to its CPU accelerator here, where it sees no GPU);
# 2. with DS_ACCELERATOR=cuda: DeepSpeed's prebuilt ops (cpu_adam, fused_adam, async_io) load as built, with no
#    compiler run (the op's own module, not a JIT build);
# 3. pip check; 4. memfit-train --help;
# 5. a GPU plan's trainer config (the tiny example planned on one L4, rendered as the operator renders it):
#    memfit-train's start-up checks refuse it with exit 2 and one line, the trainer's "no CUDA device" problem
#    alone, in the termination message too (not an import error, not a traceback).
set -eu
image=${1:?usage: images/check-cuda-trainer.sh IMAGE}
here=$(cd "$(dirname "$0")" && pwd)
job=$(cd "$here/../examples/tiny" && pwd)
export CONTAINERS_CONF="${CONTAINERS_CONF:-$here/containers.conf}"
podman=${PODMAN:-podman}
run() { $podman run --rm --network none "$@"; }
failed=0
check() {
    name=$1
    shift
    if output=$("$@" 2>&1); then
        printf 'ok    %s\n' "$name"
        printf '%s\n' "$output" | grep '^  ' || true
    else
        printf 'FAIL  %s\n%s\n' "$name" "$output"
        failed=1
    fi
}

imports='
import importlib, os, pkgutil, subprocess
import torch
assert torch.version.cuda and "+cpu" not in torch.__version__, f"not the CUDA build: {torch.__version__}"
assert not torch.cuda.is_available(), "a GPU is visible: this check is for a machine without one"
nvcc = subprocess.run([os.environ["CUDA_HOME"] + "/bin/nvcc", "--version"], capture_output=True, text=True, check=True)
release = nvcc.stdout.split("release ")[1].split(",")[0]
assert release == torch.version.cuda, f"nvcc {release} but torch is built for CUDA {torch.version.cuda}"
import transformers, peft, accelerate, datasets, bitsandbytes, deepspeed, triton, xxhash, prometheus_client
import memfit_trainer
modules = [m.name for m in pkgutil.walk_packages(memfit_trainer.__path__, "memfit_trainer.")]
for module in modules:
    importlib.import_module(module)
from deepspeed.accelerator import get_accelerator
named = os.environ.get("DS_ACCELERATOR", "unset")
print(f"  torch {torch.__version__} (CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}), nvcc {release}")
print(f"  transformers {transformers.__version__}, peft {peft.__version__}, accelerate {accelerate.__version__}, "
      f"datasets {datasets.__version__}, bitsandbytes {bitsandbytes.__version__}, triton {triton.__version__}")
print(f"  deepspeed {deepspeed.__version__}: accelerator {get_accelerator()._name} (DS_ACCELERATOR "
      f"{named}); {len(modules)} memfit_trainer modules imported")
'
ops='
import deepspeed
from deepspeed.accelerator import get_accelerator
from deepspeed.git_version_info import accelerator_name, installed_ops
from deepspeed.ops.op_builder.builder import OpBuilder
assert get_accelerator()._name == accelerator_name == "cuda", (get_accelerator()._name, accelerator_name)
def no_jit(self, verbose=True):
    raise AssertionError(f"{self.name} is not prebuilt for this accelerator: DeepSpeed would compile it")
OpBuilder.jit_load = no_jit
loaded = []
for builder in ("CPUAdamBuilder", "FusedAdamBuilder", "AsyncIOBuilder"):
    op = get_accelerator().create_op_builder(builder)
    assert installed_ops[op.name], op.name
    module = op.load(verbose=False)
    loaded.append(f"{op.name} ({module.__name__})")
print("  prebuilt and loaded: " + ", ".join(loaded))
'
gpu_plan='
import pathlib, yaml
from memfit.api.finetunejob import FineTuneJob
from memfit.api.gpupool import GPUPool
from memfit.planner.search import plan_job
from memfit.render.trainer_config import Mounts, render_trainer_config
job = FineTuneJob.model_validate(yaml.safe_load(open("/job/job.yaml")))
pool = GPUPool.model_validate({"apiVersion": "memfit.dev/v1alpha1", "kind": "GPUPool", "metadata": {"name": "l4"},
    "spec": {"gpuProduct": "NVIDIA-L4", "gpusPerNode": 1, "nodes": 1, "cpuMemoryGiBPerNode": 60}})
plan = plan_job(job.spec, [pool]).chosen
assert plan is not None and plan.strategy.gpus == 1
config = render_trainer_config(job, plan, mounts=Mounts(model=None, data="/job/data", output="/tmp/output"),
                               termination_log="/tmp/termination-log", devices=pool.spec.devices)
pathlib.Path("/tmp/config.json").write_text(config.to_json())
print(f"  plan: {plan.strategy.summary()} ({config.devices})")
'
# memfit-train as a pod starts it (entrypoint, no torchrun for one rank); its exit code, stderr and termination
# message, compared with what the trainer says of a container that sees no CUDA device.
# shellcheck disable=SC2016 # expanded by the container's shell
start='
python -c "$1" || exit 1
memfit-train --config /tmp/config.json 2>/tmp/stderr; code=$?
printf "  memfit-train exit %s: %s\n" "$code" "$(cat /tmp/stderr)"
expected="the plan is for NVIDIA GPUs but this container sees no CUDA device"
[ "$code" = 2 ] && [ "$(wc -l < /tmp/stderr)" = 1 ] && ! grep -q Traceback /tmp/stderr \
    && grep -q "^memfit-train: $expected (torch.cuda.is_available() is False)" /tmp/stderr \
    && grep -q "\"reason\": \"ConfigError\", \"message\": \"$expected" /tmp/termination-log
'

check "imports, DS_ACCELERATOR unset (a GPU pool's pod)" run --entrypoint python "$image" -c "$imports"
check "imports, DS_ACCELERATOR=cuda" run -e DS_ACCELERATOR=cuda --entrypoint python "$image" -c "$imports"
check "DeepSpeed's prebuilt CUDA-build ops load without compiling" \
    run -e DS_ACCELERATOR=cuda --entrypoint python "$image" -c "$ops"
check "pip check" run --entrypoint python "$image" -m pip check
check "memfit-train --help" sh -c "$podman run --rm --network none '$image' --help | grep -q 'usage: memfit-train'"
check "a GPU plan stops at the trainer's start-up checks: no CUDA device" \
    run -v "$job:/job:ro" --entrypoint sh "$image" -c "$start" start "$gpu_plan"
if [ "$failed" != 0 ]; then
    echo "check-cuda-trainer: $image failed a check"
    exit 1
fi
echo "check-cuda-trainer: $image passed every check"
