"""A job that types no model sizes, in the cluster: the operator profiles its model in a pod, keeps the profile
in a ConfigMap for every job of that model, and plans, launches and re-plans with it (memfit_operator.reconcile,
driven like a tiny fake cluster, as in test_reconcile). No cluster, no torch."""

from __future__ import annotations

import copy
import hashlib
import json
from typing import Any

import pytest

from memfit.api.finetunejob import FineTuneJob
from memfit.api.vocabulary import Phase
from memfit.catalog.model_configs import stored_profile, stored_profile_names
from memfit.contract.profile_message import ProfileMessageError, decode_profile_message, encode_profile_message
from memfit.contract.termination import fitted_message
from memfit.planner.replan import replan_after_oom
from memfit.planner.search import plan_job
from memfit.profile import ModelProfile
from memfit.profiled_model import ProfiledModel
from memfit_operator.objects import (
    CONFIG_SHA256_ANNOTATION,
    CONFIG_SHA256_LABEL,
    GENERATION_LABEL,
    MODEL_REFERENCE_ANNOTATION,
    PROFILE_FILE,
    PROFILING_LABEL,
    RESTRICTED_SECURITY_CONTEXT,
    TERMINATION_LOG,
    model_reference,
    profile_config_map_name,
    profile_of,
    profiling_command,
)
from memfit_operator.reconcile import wanted_profile
from tests.operator.test_reconcile import (
    POOLS,
    FakeCluster,
    job_document,
    owned_by_the_job,
    pod_names,
    quiet,
    reasons,
    trainer_config,
)

PROFILE = stored_profile("llama-3.1-8b")
assert PROFILE is not None
PROFILING_POD = "llama-chat-profile-g1"


def profiled_document(**spec: Any) -> dict[str, Any]:
    """The example job (Llama 3.1 8B from the Hub) without spec.model.architecture."""
    document = job_document(**spec)
    document["spec"]["model"].pop("architecture", None)
    return document


def on_claim(document: dict[str, Any], path: str = "qwen/") -> dict[str, Any]:
    document["spec"]["model"]["source"] = {"pvc": "models", "path": path}
    return document


def profiled(cluster: FakeCluster, profile: ModelProfile = PROFILE, name: str = PROFILING_POD) -> None:
    """The kubelet's report of a profiling pod that finished: its termination message holds the profile."""
    cluster.terminated(name, "Succeeded", 0, "Completed", encode_profile_message(profile))


def unreadable(cluster: FakeCluster, line: str, name: str = PROFILING_POD) -> None:
    """A profiling pod that refused the model with its one line (exit 2, a ConfigError message)."""
    cluster.terminated(name, "Failed", 2, "Error", fitted_message({"reason": "ConfigError"}, line))


def spec_of(cluster: FakeCluster) -> Any:
    return FineTuneJob.model_validate({k: cluster.job[k] for k in ("apiVersion", "kind", "metadata", "spec")}).spec


def expected_plan(cluster: FakeCluster, profile: ModelProfile = PROFILE) -> Any:
    return plan_job(spec_of(cluster), POOLS, model=ProfiledModel(profile)).chosen


# ================================================================================================
# The profiling pod
# ================================================================================================


def test_a_job_without_typed_sizes_gets_a_profiling_pod_and_waits_with_a_condition_and_an_event() -> None:
    cluster = FakeCluster(profiled_document())
    decision = cluster.step()
    status = decision.status
    assert status.phase is Phase.PENDING and status.plan is None and pod_names(decision) == [PROFILING_POD]
    planned, ready = cluster.condition("Planned"), cluster.condition("Ready")
    assert (planned["status"], planned["reason"]) == ("False", "Profiling")
    assert (ready["status"], ready["reason"]) == ("False", "Profiling")
    assert planned["message"] == (
        f"profiling meta-llama/Llama-3.1-8B-Instruct from its config.json (pod {PROFILING_POD})"
    )
    assert reasons(decision.events) == [("Normal", "Profiling")]
    assert decision.events[0].message == planned["message"]
    assert not [o for o in decision.create if o["kind"] == "ConfigMap"]
    # The pod is there (pending, then running): the job waits, saying nothing new.
    assert quiet(cluster.step())
    cluster.running(PROFILING_POD)
    assert quiet(cluster.step())
    assert cluster.status.phase is Phase.PENDING and cluster.condition("Planned")["reason"] == "Profiling"


def test_the_profiling_pod_is_short_cpu_only_restricted_and_reads_a_hub_config_with_the_jobs_token() -> None:
    cluster = FakeCluster(profiled_document())
    cluster.step()
    pod = cluster.pods[PROFILING_POD]
    assert pod["metadata"]["ownerReferences"] == [owned_by_the_job()]
    labels = pod["metadata"]["labels"]
    assert labels[PROFILING_LABEL] == "true" and labels[GENERATION_LABEL] == "1"
    assert "memfit.dev/attempt" not in labels
    spec = pod["spec"]
    assert spec["restartPolicy"] == "Never" and spec["automountServiceAccountToken"] is False
    assert spec["activeDeadlineSeconds"] > 0 and "nodeSelector" not in spec and "tolerations" not in spec
    assert spec["securityContext"]["runAsNonRoot"] is True
    [container] = spec["containers"]
    assert container["image"] == "registry.example/memfit-trainer:0.1.0"
    assert container["securityContext"] == RESTRICTED_SECURITY_CONTEXT
    resources = container["resources"]
    assert set(resources["requests"]) == set(resources["limits"]) == {"cpu", "memory"}  # no GPU
    assert resources["requests"] == {"cpu": "1", "memory": "2Gi"}
    assert container["command"] == [
        "python", "-m", "memfit_trainer.profile", "meta-llama/Llama-3.1-8B-Instruct", "--activations", "--hub",
        "--termination-log", "/dev/termination-log",
    ]  # fmt: skip
    assert container["terminationMessagePath"] == TERMINATION_LOG and container["terminationMessagePolicy"] == "File"
    env = {e["name"]: e for e in container["env"]}
    assert env["HF_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "hf-token", "key": "token"}}
    assert "value" not in env["HF_TOKEN"] and "HF_HUB_OFFLINE" not in env
    # Every place it writes is a bounded volume (the root filesystem is read-only).
    assert {v["name"] for v in spec["volumes"]} == {"tmp", "cache"}
    assert all(v["emptyDir"]["sizeLimit"] for v in spec["volumes"])


def test_a_model_on_a_claim_is_profiled_from_the_claim_mounted_read_only_where_the_trainer_pods_mount_it() -> None:
    cluster = FakeCluster(on_claim(profiled_document(lora={"targetModules": ["v_proj", "q_proj"]}), "/qwen/moe/"))
    cluster.step()
    [container] = cluster.pods[PROFILING_POD]["spec"]["containers"]
    assert container["command"] == [
        "python", "-m", "memfit_trainer.profile", "/mnt/model/qwen/moe", "--activations",
        "--lora-targets", "q_proj,v_proj", "--termination-log", "/dev/termination-log",
    ]  # fmt: skip
    assert {"name": "model", "mountPath": "/mnt/model", "readOnly": True} in container["volumeMounts"]
    volumes = {v["name"]: v for v in cluster.pods[PROFILING_POD]["spec"]["volumes"]}
    assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    env = {e["name"]: e for e in container["env"]}
    assert env["HF_HUB_OFFLINE"]["value"] == "1" and "HF_TOKEN" not in env
    assert profiling_command(spec_of(cluster)) == container["command"]


# ================================================================================================
# Its result: the profile ConfigMap, the plan, the trainer config
# ================================================================================================


def test_a_profiled_model_is_stored_planned_and_launched_with_its_planned_fields() -> None:
    cluster = FakeCluster(profiled_document())
    cluster.step()
    profiled(cluster)
    decision = cluster.step()
    name = profile_config_map_name(spec_of(cluster))
    assert reasons(decision.events) == [("Normal", "Profiled"), ("Normal", "Planned"), ("Normal", "Launching")]
    assert decision.events[0].message == (
        "profiled LlamaForCausalLM (llama, 8.03B parameters, config.json sha256 "
        f"{PROFILE.config_sha256[:12]}...); stored in ConfigMap {name} for every job of "
        "hub:meta-llama/Llama-3.1-8B-Instruct"
    )
    status = decision.status
    plan = expected_plan(cluster)
    assert status.phase is Phase.LAUNCHING and status.plan == plan
    assert cluster.condition("Planned")["status"] == "True" and cluster.condition("Ready")["status"] == "True"
    # The profile ConfigMap: immutable, owned by no job, labelled for the next job of the model.
    stored = cluster.others[("ConfigMap", name)]
    assert stored["immutable"] is True and "ownerReferences" not in stored["metadata"]
    assert stored["metadata"]["labels"][CONFIG_SHA256_LABEL] == PROFILE.config_sha256[:63]
    annotations = stored["metadata"]["annotations"]
    assert annotations[CONFIG_SHA256_ANNOTATION] == PROFILE.config_sha256
    assert annotations[MODEL_REFERENCE_ANNOTATION] == "hub:meta-llama/Llama-3.1-8B-Instruct"
    assert ModelProfile.model_validate_json(stored["data"][PROFILE_FILE]) == PROFILE
    # The trainer checks it loads the profiled model.
    model = trainer_config(cluster, 1)["model"]
    assert model["plannedFields"] == ProfiledModel(PROFILE).planned_fields() and model.get("architecture") is None
    # The next pass sees the ConfigMap: the finished profiling pod goes, nothing else changes.
    decision = cluster.step()
    assert decision.delete == [PROFILING_POD] and not decision.create and not decision.events
    assert quiet(cluster.step())
    assert cluster.attempt_pods(1) == ["llama-chat-a1-n0"]


def test_the_stored_configmap_round_trips_to_the_same_plan() -> None:
    cluster = FakeCluster(profiled_document())
    cluster.step()
    profiled(cluster)
    cluster.step()
    stored = json.loads(json.dumps(cluster.others[("ConfigMap", profile_config_map_name(spec_of(cluster)))]))
    again = profile_of(stored)
    assert again == PROFILE == decode_profile_message(encode_profile_message(PROFILE))
    assert ProfiledModel(again) == ProfiledModel(PROFILE)
    assert expected_plan(cluster, again) == cluster.status.plan


def test_a_second_job_of_the_same_model_reuses_the_stored_profile_without_profiling() -> None:
    first = FakeCluster(profiled_document())
    first.step()
    profiled(first)
    first.step()
    second_document = profiled_document()
    second_document["metadata"].update({"name": "llama-chat-2", "uid": "second-uid"})
    second = FakeCluster(second_document)
    name = profile_config_map_name(spec_of(first))
    second.others[("ConfigMap", name)] = copy.deepcopy(first.others[("ConfigMap", name)])
    assert wanted_profile(second.observe().job) == name
    decision = second.step()
    assert not [o for o in decision.create if o["metadata"]["name"].endswith("-profile-g1")]
    assert reasons(decision.events) == [("Normal", "Planned"), ("Normal", "Launching")]
    assert decision.status.plan == first.status.plan
    assert pod_names(decision) == ["llama-chat-2-a1-n0"]


def test_other_lora_targets_or_another_model_get_a_profile_of_their_own() -> None:
    base = spec_of(FakeCluster(profiled_document()))
    targets = spec_of(FakeCluster(profiled_document(lora={"targetModules": ["q_proj"]})))
    claim = spec_of(FakeCluster(on_claim(profiled_document())))
    same_claim = spec_of(FakeCluster(on_claim(profiled_document(), "/qwen")))
    names = {profile_config_map_name(s) for s in (base, targets, claim)}
    assert len(names) == 3 and profile_config_map_name(claim) == profile_config_map_name(same_claim)
    assert model_reference(claim) == "pvc:models/qwen"


def test_a_job_with_typed_sizes_needs_no_profile() -> None:
    cluster = FakeCluster(job_document())
    assert wanted_profile(cluster.observe().job) is None
    decision = cluster.step()
    assert pod_names(decision) == ["llama-chat-a1-n0"]


def test_a_re_plan_after_out_of_memory_plans_the_same_profiled_model() -> None:
    cluster = FakeCluster(profiled_document())
    cluster.step()
    profiled(cluster)
    cluster.step()
    cluster.step()  # the profiling pod goes
    cluster.running()
    cluster.step()
    first = cluster.status.plan
    assert first is not None
    cluster.trainer_oom("llama-chat-a1-n0")
    decision = cluster.step()
    assert reasons(decision.events) == [("Warning", "OutOfMemory"), ("Normal", "Replanned"), ("Normal", "Launching")]
    replanned = decision.status.plan
    expected, _ = replan_after_oom(spec_of(cluster), POOLS, first, [first.strategy.identity()], ProfiledModel(PROFILE))
    assert replanned is not None and replanned == expected.chosen
    assert trainer_config(cluster, 2)["model"]["plannedFields"] == ProfiledModel(PROFILE).planned_fields()


# ================================================================================================
# A model that cannot be profiled
# ================================================================================================


def test_a_model_without_config_json_makes_the_job_invalid_with_the_pods_line_until_the_spec_changes() -> None:
    cluster = FakeCluster(on_claim(profiled_document()))
    cluster.step()
    unreadable(cluster, "/mnt/model/qwen: no config.json in this directory")
    decision = cluster.step()
    assert decision.status.phase is Phase.INVALID and decision.status.plan is None and not decision.create
    planned = cluster.condition("Planned")
    assert (planned["status"], planned["reason"]) == ("False", "ModelUnreadable")
    assert planned["message"].startswith(
        "pvc:models/qwen cannot be planned from its profile: /mnt/model/qwen: no config.json in this directory "
        f"(pod {PROFILING_POD}); fix the model"
    )
    assert cluster.condition("Ready")["reason"] == "ModelUnreadable"
    assert reasons(decision.events) == [("Warning", "ModelUnreadable")]
    assert decision.events[0].message == planned["message"]
    assert quiet(cluster.step()) and PROFILING_POD in cluster.pods  # kept for its logs
    # A changed spec profiles again, in a pod of its own.
    cluster.edit_spec(model={**cluster.job["spec"]["model"], "source": {"pvc": "models", "path": "qwen3/"}})
    decision = cluster.step()
    assert decision.delete == [PROFILING_POD] and pod_names(decision) == ["llama-chat-profile-g2"]
    assert decision.status.phase is Phase.PENDING and cluster.condition("Planned")["reason"] == "Profiling"
    profiled(cluster, name="llama-chat-profile-g2")
    assert cluster.step().status.phase is Phase.LAUNCHING


@pytest.mark.parametrize(
    ("exit_code", "reason", "message", "says"),
    [
        (137, "OOMKilled", None, "the profiler ran out of host memory (OOMKilled)"),
        (1, "Error", "Traceback (most recent call last): ...", "the profiler failed with exit code 1 (Error)"),
        (0, "Completed", "bm90IGEgcHJvZmlsZQ==", "reported no profile memfit reads: not an encoded profile"),
    ],
)
def test_a_profiling_pod_that_fails_otherwise_says_how(
    exit_code: int, reason: str, message: str | None, says: str
) -> None:
    cluster = FakeCluster(profiled_document())
    cluster.step()
    cluster.terminated(PROFILING_POD, "Succeeded" if exit_code == 0 else "Failed", exit_code, reason, message)
    decision = cluster.step()
    assert decision.status.phase is Phase.INVALID and says in cluster.condition("Planned")["message"]


def test_a_profiling_pod_past_its_deadline_fails_the_profiling() -> None:
    cluster = FakeCluster(profiled_document())
    cluster.step()
    cluster.pods[PROFILING_POD]["status"] = {"phase": "Failed", "reason": "DeadlineExceeded",
                                             "message": "Pod was active on the node longer than specified"}  # fmt: skip
    cluster.step()
    assert "the profiling pod failed: Pod was active" in cluster.condition("Planned")["message"]


def test_a_damaged_profile_configmap_is_reported_not_trusted() -> None:
    cluster = FakeCluster(profiled_document())
    cluster.step()
    profiled(cluster)
    cluster.step()
    name = profile_config_map_name(spec_of(cluster))
    second_document = profiled_document()
    second_document["metadata"].update({"name": "other", "uid": "other-uid"})
    second = FakeCluster(second_document)
    damaged = copy.deepcopy(cluster.others[("ConfigMap", name)])
    damaged["data"][PROFILE_FILE] = '{"version": 3}'
    second.others[("ConfigMap", name)] = damaged
    decision = second.step()
    assert decision.status.phase is Phase.INVALID and not decision.create
    assert f"ConfigMap {name} holds no profile memfit reads" in second.condition("Planned")["message"]


def test_profiling_pods_go_once_the_spec_types_the_sizes() -> None:
    cluster = FakeCluster(profiled_document())
    cluster.step()
    cluster.edit_spec(model={**cluster.job["spec"]["model"], "architecture": {"preset": "llama-3.1-8b"}})
    decision = cluster.step()
    assert PROFILING_POD in decision.delete and pod_names(decision) == ["llama-chat-a1-n0"]


# ================================================================================================
# The termination message
# ================================================================================================


def test_a_profile_message_fits_a_termination_message_and_round_trips() -> None:
    message = encode_profile_message(PROFILE)
    assert len(message) <= 4096 and message.isascii()
    assert encode_profile_message(PROFILE) == message  # deterministic (xz stores no timestamp)
    assert decode_profile_message(message) == PROFILE


@pytest.mark.parametrize("name", stored_profile_names())
@pytest.mark.slow
def test_every_stored_models_profile_fits_a_termination_message(name: str) -> None:
    """The operator receives a profile through the pod's termination message: every model memfit stores (up to
    gpt-oss-120b's four traced setups with both losses) must pass through it."""
    profile = stored_profile(name)
    assert profile is not None
    assert decode_profile_message(encode_profile_message(profile)) == profile


@pytest.mark.parametrize("message", ["", '{"reason": "ConfigError"}', "aGVsbG8=", "!!!"])
def test_anything_else_is_not_a_profile(message: str) -> None:
    with pytest.raises(ProfileMessageError):
        decode_profile_message(message)


def test_a_profile_too_large_for_a_termination_message_is_refused() -> None:
    # Names no compressor shortens (digests), so the encoded message outgrows 4096 bytes.
    tensors = tuple(group.model_copy(update={"name": f"{group.name}.{hashlib.sha256(bytes([i])).hexdigest()}"})
                    for i, group in enumerate(PROFILE.tensors * 20))  # fmt: skip
    # Distinct groups of the same total would not validate as a model; the size check comes first.
    large = PROFILE.model_copy(update={"tensors": tensors})
    with pytest.raises(ProfileMessageError, match="more than the 4096 bytes a termination message holds"):
        encode_profile_message(large)
