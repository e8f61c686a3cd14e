"""Base class and shared pieces of memfit's Kubernetes API models.

Field docstrings become the ``description`` of every field in the generated CRD (``kubectl explain``),
so they are written for the person reading them there.
"""

from __future__ import annotations

from typing import Annotated, Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

GROUP: Final = "memfit.dev"
VERSION: Final = "v1alpha1"
API_VERSION: Final = "memfit.dev/v1alpha1"
"""GROUP/VERSION, spelled out so that the type checker knows it is the models' Literal apiVersion."""

NonEmptyStr = Annotated[str, Field(min_length=1)]

ACRONYMS = {"gpu": "GPU", "gpus": "GPUs", "gib": "GiB", "gbps": "GBps", "tflops": "TFLOPS"}
"""Words that keep their capitals inside a camelCase name (maxGPUs, gpuMemoryGiB, peakTFLOPS)."""


def to_camel(name: str) -> str:
    """snake_case -> camelCase as Kubernetes APIs spell it, acronyms included."""
    first, *rest = name.split("_")
    return first + "".join(ACRONYMS.get(word, word.capitalize()) for word in rest)


class ApiModel(BaseModel):
    """camelCase on the wire, snake_case in Python; unknown fields are errors, not silently dropped."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        use_attribute_docstrings=True,
        validate_default=True,
    )

    def to_api(self) -> dict[str, Any]:
        """The object as Kubernetes stores it: camelCase keys, unset optional fields left out."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


class SecretKeyRef(ApiModel):
    """A key of a Secret in the job's namespace."""

    name: NonEmptyStr
    """Name of the Secret."""
    key: NonEmptyStr = "token"
    """Key inside the Secret whose value is used."""


class Source(ApiModel):
    """Where files come from: a PersistentVolumeClaim (`pvc` + `path`) or the Hugging Face Hub (`hub`)."""

    pvc: NonEmptyStr | None = None
    """Name of a PersistentVolumeClaim in the job's namespace that holds the files."""
    path: str | None = None
    """Path inside the claim (defaults to its root). Only with `pvc`."""
    hub: NonEmptyStr | None = None
    """Hugging Face Hub repository id, e.g. `meta-llama/Llama-3.1-8B`."""
    token_secret_ref: SecretKeyRef | None = None
    """Secret holding the Hub token (never put the token itself in the spec). Only with `hub`."""

    @model_validator(mode="after")
    def _one_kind(self) -> Source:
        if (self.pvc is None) == (self.hub is None):
            raise ValueError("set exactly one of `pvc` (with `path`) or `hub` (with `tokenSecretRef`)")
        if self.pvc is not None and self.token_secret_ref is not None:
            raise ValueError("`tokenSecretRef` goes with `hub`, not with `pvc`")
        if self.hub is not None and self.path is not None:
            raise ValueError("`path` goes with `pvc`, not with `hub`")
        return self


class VolumePath(ApiModel):
    """A directory on a PersistentVolumeClaim."""

    pvc: NonEmptyStr
    """Name of a PersistentVolumeClaim in the job's namespace."""
    path: str = "/"
    """Directory inside the claim."""


class Toleration(ApiModel):
    """A Kubernetes toleration, copied to the trainer pods."""

    key: str | None = None
    """Taint key the toleration applies to; empty matches all keys (with operator Exists)."""
    operator: Literal["Exists", "Equal"] | None = None
    """How the key relates to the value."""
    value: str | None = None
    """Taint value the toleration matches (with operator Equal)."""
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    """Taint effect to match; empty matches all effects."""
    toleration_seconds: int | None = None
    """How long a NoExecute taint is tolerated before eviction."""


class Condition(ApiModel):
    """A status condition as the Kubernetes API conventions define it."""

    type: NonEmptyStr
    """Type of condition, e.g. Ready, Planned, Running, Succeeded, Suspended."""
    status: Literal["True", "False", "Unknown"]
    """Whether the condition holds."""
    reason: NonEmptyStr
    """One CamelCase word for machines: why the condition last changed."""
    message: str = ""
    """A sentence for people: details of the last change."""
    last_transition_time: str
    """When the condition last changed status (RFC 3339)."""
    observed_generation: int | None = None
    """The `.metadata.generation` the condition was set for."""


class ObjectMeta(ApiModel):
    """The part of Kubernetes object metadata memfit reads."""

    model_config = ConfigDict(extra="allow")

    name: NonEmptyStr
    """Object name."""
    namespace: str | None = None
    """Namespace (FineTuneJobs are namespaced; GPUPools are cluster-scoped)."""
    labels: dict[str, str] = Field(default_factory=dict)
    """Labels."""
    annotations: dict[str, str] = Field(default_factory=dict)
    """Annotations."""
