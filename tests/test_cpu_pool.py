"""CPU pools (``gpuProduct: cpu``): ranks whose memory is the node's RAM, planned against one budget, and pods
that ask for CPU and memory only, with the CPU trainer image and DeepSpeed told its accelerator."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from memfit.api.finetunejob import FineTuneJob
from memfit.api.gpupool import CPU_PRODUCT, CPU_RANK_TFLOPS, GPUPool, pool_capacity
from memfit.api.loading import load_documents
from memfit.planner.search import plan_job
from memfit.render.trainer_config import render_trainer_config
from memfit.units import GIB
from memfit_operator import objects

ROOT = Path(__file__).resolve().parent.parent
IMAGE, CPU_IMAGE = "registry.example/memfit-trainer:1", "registry.example/memfit-trainer:1-cpu"


def cpu_pool(**spec: object) -> GPUPool:
    document = load_documents(ROOT / "examples" / "cpu" / "pool.yaml").pools[0].model_dump(by_alias=True)
    document["spec"].update(spec)
    return GPUPool.model_validate(document)


def tiny_job() -> FineTuneJob:
    (job,) = load_documents(ROOT / "examples" / "tiny" / "job.yaml").jobs
    return job.model_copy(update={"metadata": job.metadata.model_copy(update={"uid": "u-1"})})


def test_a_ranks_memory_defaults_to_its_share_of_the_nodes_ram() -> None:
    capacity = pool_capacity(cpu_pool(gpusPerNode=2, cpuMemoryGiBPerNode=8.0))
    assert capacity.cpu_only and capacity.product == CPU_PRODUCT
    assert capacity.gpu_memory_bytes == 4 * GIB and capacity.cpu_memory_bytes_per_node == 8 * GIB
    assert capacity.peak_flops_bf16 == CPU_RANK_TFLOPS * 1e12  # an estimate unless the pool gives its own
    assert pool_capacity(cpu_pool(peakTFLOPS={"bf16": 2.0})).peak_flops_bf16 == 2e12


def test_ranks_given_more_memory_than_the_node_has_are_refused() -> None:
    with pytest.raises(ValidationError, match=r"gpusPerNode x gpuMemoryGiB \(2 x 3\) is more than cpuMemoryGiBPerNode"):
        cpu_pool(gpusPerNode=2, gpuMemoryGiB=3.0, cpuMemoryGiBPerNode=4.0)


def test_the_ranks_and_the_host_share_the_nodes_ram() -> None:
    job = tiny_job()
    plan = plan_job(job.spec, [cpu_pool(nodes=1)]).chosen
    assert plan is not None and plan.strategy.pool == "cpu"
    memory = plan.memory
    assert memory.per_gpu.total + memory.per_node.cpu <= 8 * GIB
    # A node whose RAM holds the rank's memory or the host's, but not both, does not fit it.
    between = (max(memory.per_gpu.total, memory.per_node.cpu) + memory.per_gpu.total + memory.per_node.cpu) / 2
    result = plan_job(job.spec, [cpu_pool(cpuMemoryGiBPerNode=between / GIB, nodes=1)])
    assert result.chosen is None
    assert "its ranks' memory included" in " ".join(c.reason for c in result.rejected)


def test_pods_on_a_cpu_pool_ask_for_no_gpu_and_run_the_cpu_image() -> None:
    job, pool = tiny_job(), cpu_pool(nodes=2)
    spec = job.spec.model_copy(update={"resources": job.spec.resources.model_copy(update={"max_gpus": 2})})
    job = job.model_copy(update={"spec": spec})
    plan = plan_job(job.spec, [pool]).chosen
    assert plan is not None and (plan.strategy.nodes, plan.strategy.gpus_per_node) == (2, 1)
    options = objects.TrainerOptions(cpu_image=CPU_IMAGE)
    pods = [m for m in objects.attempt_objects(job, plan, pool, render_trainer_config(job, plan), 1, IMAGE, options)
            if m["kind"] == "Pod"]  # fmt: skip
    assert len(pods) == 2
    for pod in pods:
        (container,) = pod["spec"]["containers"]
        assert container["image"] == CPU_IMAGE
        assert objects.GPU_RESOURCE not in container["resources"]["requests"]
        assert objects.GPU_RESOURCE not in container["resources"]["limits"]
        assert "nvidia.com/gpu.product" not in pod["spec"]["nodeSelector"]
        assert {"name": "DS_ACCELERATOR", "value": "cpu"} in container["env"]
        assert (container["resources"]["requests"]["cpu"], container["resources"]["limits"]["cpu"]) == ("500m", "1")
        assert {"name": "OMP_NUM_THREADS", "value": "1"} in container["env"]
        requested = int(container["resources"]["requests"]["memory"].removesuffix("Mi")) * 2**20
        assert requested >= plan.memory.per_gpu.total + plan.memory.per_node.cpu  # the rank's memory is RAM
        assert int(container["resources"]["limits"]["memory"].removesuffix("Mi")) * 2**20 <= 8 * GIB
    # Without a CPU image the one image serves; GPU pools never get the CPU image.
    plain = objects.trainer_pod(job, plan, pool, 1, 0, IMAGE)
    assert plain["spec"]["containers"][0]["image"] == IMAGE
