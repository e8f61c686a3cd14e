"""The whole product on a real node: the chart installed as the README says, a FineTuneJob applied with
kubectl, and its pods really running the trainer image (containerd, runc, CNI, cluster DNS).

Run by ``make e2e`` (never by ``make test``): it needs root, containerd and the images ``make images`` builds.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.cluster import REPO, apply, get, host_claim, items, kubectl, namespace, wait_for

NAMESPACE = "e2e"
EXAMPLES = ("tiny", "chat-validation")
"""The examples whose data the data claim holds (each under its own folder)."""
TRAIN_SECONDS = 1200.0
"""A generous bound for a tiny job's pods to start and train (nothing here depends on a machine's speed)."""


def example_job(example: str, name: str, *, spec: dict[str, Any] | None = None, **training: Any) -> dict[str, Any]:
    """examples/EXAMPLE/job.yaml named ``name`` in this namespace on the CPU pool, as a gang of two pods (one
    rank each), its data under EXAMPLE/ on the data claim, its output under NAME/ on the output claim."""
    document: dict[str, Any] = yaml.safe_load((REPO / "examples" / example / "job.yaml").read_text())
    document["metadata"] = {"name": name, "namespace": NAMESPACE}
    document["spec"]["dataset"]["source"]["path"] = f"{example}/{document['spec']['dataset']['source']['path']}"
    document["spec"]["resources"] = {"pool": "cpu", "maxGPUs": 2}
    document["spec"]["training"].update(training)
    document["spec"]["output"] = {"pvc": "output", "path": f"{name}/"}
    document["spec"].update(spec or {})
    return document


def status(name: str) -> dict[str, Any]:
    status: dict[str, Any] = (get("finetunejob", name, NAMESPACE) or {}).get("status", {})
    return status


def wait_until_done(name: str, *, seen: Callable[[dict[str, Any]], None] = lambda _: None) -> dict[str, Any]:
    """The job's status once it has Succeeded (``seen`` gets every status on the way); Failed ends the test."""

    def succeeded() -> dict[str, Any] | None:
        current = status(name)
        seen(current)
        if current.get("phase") == "Failed":
            raise AssertionError(f"job {name} failed\n{describe(name)}")
        return current if current.get("phase") == "Succeeded" else None

    return wait_for(f"job {name} to succeed", succeeded, TRAIN_SECONDS, lambda: describe(name))


def show_in_readme(command: str, output: str) -> None:
    """Put ``output`` into the README's block after the line ``$ COMMAND`` (as tests/readme_outputs.py does for
    `memfit plan`): the README shows what this run printed, never a hand-edited copy."""
    readme = REPO / "README.md"
    text = readme.read_text()
    start = text.index(f"$ {command}\n") + len(f"$ {command}\n")
    readme.write_text(text[:start] + output + text[text.index("```", start) :])


def pods_of(name: str) -> list[dict[str, Any]]:
    return items("pods", NAMESPACE, f"memfit.dev/job={name}")


def describe(name: str) -> str:
    """The job's status and its pods, for a failure message."""
    job = get("finetunejob", name, NAMESPACE) or {}
    pods = kubectl("get", "pods", "-n", NAMESPACE, "-o", "wide", check=False)
    events = kubectl("get", "events", "-n", NAMESPACE, "--sort-by=.lastTimestamp", check=False)
    return f"status: {yaml.safe_dump(job.get('status', {}))}\npods:\n{pods}\nevents:\n{events[-4000:]}"


@pytest.fixture(scope="module")
def volumes(installed: list[dict[str, Any]], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("claims")
    data, output = root / "data", root / "output"
    for example in EXAMPLES:
        shutil.copytree(REPO / "examples" / example / "data", data / example)
    apply([namespace(NAMESPACE)])
    apply(host_claim(NAMESPACE, "data", data) + host_claim(NAMESPACE, "output", output))
    return {"data": data, "output": output}


def test_the_tiny_job_trains_to_the_end_as_a_gang_of_two_pods(volumes: dict[str, Path]) -> None:
    name = "tiny"
    # Long enough (tens of seconds) for the operator to read rank 0's progress while it runs (every 15 s).
    apply([example_job("tiny", name, maxSteps=300, checkpointEverySteps=100)])
    ranks: set[tuple[str, str]] = set()
    steps: set[int] = set()

    def seen(current: dict[str, Any]) -> None:
        for pod in pods_of(name):
            labels = pod["metadata"]["labels"]
            ranks.add((labels["memfit.dev/attempt"], labels["memfit.dev/node-rank"]))
        steps.add((current.get("progress") or {}).get("step", 0))

    done = wait_until_done(name, seen=seen)
    strategy = done["plan"]["strategy"]
    assert (strategy["pool"], strategy["nodes"], strategy["gpusPerNode"]) == ("cpu", 2, 1)
    assert ranks == {("1", "0"), ("1", "1")}  # one attempt, two pods
    assert any(0 < step <= 300 for step in steps), steps  # read from rank 0's metrics endpoint while running
    final = volumes["output"] / name / "final"
    assert final.is_dir() and any(final.glob("*.safetensors")), sorted(p.name for p in final.parent.iterdir())
    table = kubectl("get", "finetunejobs", "-n", NAMESPACE)
    assert name in table and "Succeeded" in table
    show_in_readme(f"kubectl get finetunejobs -n {NAMESPACE}", table)


def test_a_chat_job_with_validation_on_fsdp2(volumes: dict[str, Path]) -> None:
    name = "chat"
    apply([example_job("chat-validation", name, spec={"strategy": {"engine": "fsdp2"}}, maxSteps=20)])
    done = wait_until_done(name)
    assert done["plan"]["strategy"]["engine"] == "fsdp2"
    assert done["progress"]["validationStep"] == 20 and done["progress"]["validationLoss"] > 0
    assert any((volumes["output"] / name / "final").glob("*.safetensors"))


def test_a_lora_job(volumes: dict[str, Path]) -> None:
    name = "lora"
    apply([example_job("tiny", name, spec={"method": "lora"}, maxSteps=20, learningRate=0.0002)])
    done = wait_until_done(name)
    assert done["plan"]["strategy"]["method"] == "lora"
    assert any((volumes["output"] / name / "final").glob("adapter_model.safetensors"))


FAULT_STEPS = 400
"""The steps of a job a fault hits: a first checkpoint at step 50, seen by the operator (it reads progress every
15 s) a few dozen steps later, leaves hundreds of steps (minutes here, at about 0.6 s a step) for the fault to
land in a running job."""


def checkpointed_gang(name: str) -> tuple[int, str]:
    """A tiny job of :data:`FAULT_STEPS` steps past its first checkpoint, as the operator read it: that step,
    and the name of its rank-1 pod (the one a fault hits)."""
    apply([example_job("tiny", name, maxSteps=FAULT_STEPS, checkpointEverySteps=50)])
    checkpointed: int = wait_for(
        "a first checkpoint",
        lambda: (status(name).get("progress") or {}).get("lastCheckpointStep"),
        TRAIN_SECONDS,
        lambda: describe(name),
    )
    [victim] = [p["metadata"]["name"] for p in pods_of(name) if p["metadata"]["labels"]["memfit.dev/node-rank"] == "1"]
    return checkpointed, victim


def test_a_deleted_trainer_pod_restarts_the_gang_from_its_last_checkpoint(volumes: dict[str, Path]) -> None:
    name = "restart"
    checkpointed, victim = checkpointed_gang(name)
    kubectl("delete", "pod", victim, "-n", NAMESPACE, "--wait=false")
    done = wait_until_done(name)
    assert done["restarts"] == 1
    first, second = done["attempts"]
    assert first["outcome"] == "Failed" and second["outcome"] == "Succeeded"
    assert second["resumedFromStep"] >= checkpointed  # from its newest checkpoint, not from step 0
    assert done["progress"]["step"] == FAULT_STEPS


LEAK_BLOCK_MIB = 64


def test_a_container_over_its_memory_limit_is_oom_killed_and_the_job_replans_and_resumes(
    volumes: dict[str, Path],
) -> None:
    """A container that exceeds its memory limit as a leak would: a process in rank 1's container fills the
    pod's memory-backed /dev/shm, which the kernel charges to the container, until the OOM killer ends the
    trainer there (its largest process); the kubelet reports OOMKilled, and the operator re-plans leaner,
    excluding the plan that ran out, and resumes from the last checkpoint."""
    name = "oom"
    checkpointed, victim = checkpointed_gang(name)
    planned = status(name)["plan"]["strategy"]
    leak = f"i=0; while head -c {LEAK_BLOCK_MIB * 2**20} /dev/zero > /dev/shm/leak-$i; do i=$((i+1)); done"
    kubectl("exec", victim, "-n", NAMESPACE, "-c", "trainer", "--", "sh", "-c", leak, check=False)
    done = wait_until_done(name)
    first, second = done["attempts"]
    assert first["outcome"] == "OutOfMemory" and second["outcome"] == "Succeeded", done["attempts"]
    assert done["replans"] == 1 and len(done["excludedStrategies"]) == 1
    assert done["plan"]["strategy"] != planned  # a leaner plan
    assert second["resumedFromStep"] >= checkpointed  # from its newest checkpoint, not from step 0
    assert done["progress"]["step"] == FAULT_STEPS
    reasons = [line.split()[0] for line in warnings(name).splitlines()[1:] if line.strip()]
    assert "OutOfMemory" in reasons, warnings(name)


def test_suspend_resume_and_delete_with_real_pods(volumes: dict[str, Path]) -> None:
    name = "lifecycle"
    apply([example_job("tiny", name, maxSteps=5000, checkpointEverySteps=50)])  # deleted long before its end
    wait_for("a first checkpoint", lambda: (status(name).get("progress") or {}).get("lastCheckpointStep"),
             TRAIN_SECONDS, lambda: describe(name))  # fmt: skip
    kubectl("patch", "finetunejob", name, "-n", NAMESPACE, "--type=merge", "-p", '{"spec": {"suspend": true}}')
    wait_for("the suspended job's pods to go", lambda: status(name).get("phase") == "Suspended" and not pods_of(name),
             TRAIN_SECONDS, lambda: describe(name))  # fmt: skip
    kubectl("patch", "finetunejob", name, "-n", NAMESPACE, "--type=merge", "-p", '{"spec": {"suspend": false}}')
    wait_for("the resumed job to run again", lambda: status(name).get("phase") == "Running" and pods_of(name),
             TRAIN_SECONDS, lambda: describe(name))  # fmt: skip
    assert status(name)["attempts"][-1]["resumedFromStep"] >= 50
    kubectl("delete", "finetunejob", name, "-n", NAMESPACE)
    selector = f"memfit.dev/job={name}"
    wait_for("every child to be deleted",
             lambda: not any(items(kind, NAMESPACE, selector) for kind in ("pods", "configmaps", "services")),
             TRAIN_SECONDS, lambda: describe(name))  # fmt: skip


def failed_with(name: str) -> dict[str, Any]:
    """The job's status once Failed (a Succeeded job ends the test)."""

    def failed() -> dict[str, Any] | None:
        current = status(name)
        if current.get("phase") == "Succeeded":
            raise AssertionError(f"job {name} succeeded\n{describe(name)}")
        return current if current.get("phase") == "Failed" else None

    return wait_for(f"job {name} to fail", failed, TRAIN_SECONDS, lambda: describe(name))


def condition(current: dict[str, Any], type_: str) -> dict[str, Any]:
    found: list[dict[str, Any]] = [c for c in current["conditions"] if c["type"] == type_]
    assert len(found) == 1, current["conditions"]
    return found[0]


def warnings(name: str) -> str:
    """The job's Warning events, one ``REASON MESSAGE`` line each."""
    selector = f"involvedObject.name={name},type=Warning"
    columns = "custom-columns=REASON:.reason,MESSAGE:.message"
    return kubectl("get", "events", "-n", NAMESPACE, "--field-selector", selector, "-o", columns)


def test_a_missing_model_directory_fails_the_job_once_with_a_clear_condition(volumes: dict[str, Path]) -> None:
    name = "no-model"
    job = example_job("tiny", name)
    job["spec"]["model"].update({"randomInit": False, "source": {"pvc": "data", "path": "no-such-model"}})
    apply([job])
    done = failed_with(name)
    succeeded = condition(done, "Succeeded")
    assert succeeded["reason"] == "TrainerConfigError" and "no-such-model" in succeeded["message"], succeeded
    assert done["restarts"] == 0 and len(done["attempts"]) == 1  # no restart loop
    assert any(line.startswith("Failed") and "no-such-model" in line for line in warnings(name).splitlines())


def test_a_gpu_pool_whose_node_has_no_device_fails_once_with_the_trainers_reason(
    volumes: dict[str, Path], advertised_gpus: str
) -> None:
    name = "no-device"
    job = example_job("tiny", name)
    job["spec"]["resources"] = {"pool": "l4", "maxGPUs": 1}
    apply([job])
    done = failed_with(name)
    assert done["plan"]["strategy"]["pool"] == "l4"
    succeeded = condition(done, "Succeeded")
    assert succeeded["reason"] == "TrainerConfigError" and "sees no CUDA device" in succeeded["message"], succeeded
    assert done["restarts"] == 0 and len(done["attempts"]) == 1


def test_the_operator_deleted_mid_job_is_replaced_and_adopts_it(volumes: dict[str, Path]) -> None:
    name = "adopted"
    apply([example_job("tiny", name, maxSteps=FAULT_STEPS, checkpointEverySteps=100)])
    wait_for("the job to report progress", lambda: (status(name).get("progress") or {}).get("step"),
             TRAIN_SECONDS, lambda: describe(name))  # fmt: skip
    operators = "app.kubernetes.io/component=operator"
    before = {p["metadata"]["name"] for p in items("pods", "memfit-system", operators)}
    kubectl("delete", "pods", "-n", "memfit-system", "-l", operators, "--wait=false")
    done = wait_until_done(name)
    after = {p["metadata"]["name"] for p in items("pods", "memfit-system", operators)}
    assert after and not after & before  # new operator pods finished the job
    assert done["restarts"] == 0 and len(done["attempts"]) == 1 and done["progress"]["step"] == FAULT_STEPS
    assert sorted(p["metadata"]["name"] for p in pods_of(name)) == [f"{name}-a1-n0", f"{name}-a1-n1"]  # no duplicates
