"""Base class and shared pieces of memfit's Kubernetes API models.

Field docstrings become the ``description`` of every field in the generated CRD (``kubectl explain``),
so they are written for the person reading them there.
"""

from __future__ import annotations

import re
import reprlib
from pathlib import PurePosixPath
from typing import Annotated, Any, Final, Literal

from pydantic import AfterValidator, AllowInfNan, BaseModel, ConfigDict, Field, Strict, field_validator, model_validator

GROUP: Final = "memfit.dev"
VERSION: Final = "v1alpha1"
API_VERSION: Final = "memfit.dev/v1alpha1"
"""GROUP/VERSION, spelled out so that the type checker knows it is the models' Literal apiVersion."""

# Strict scalars, as the API server's structural schema checks them: a string is never a number or a boolean
# ("64", "yes"), a float is never an integer (2.0), a boolean is never a number. Integers are numbers (JSON
# has one number type), so a `number` field takes 2 as well as 2.0; infinities and NaN are refused (JSON
# cannot carry them, and the planner's arithmetic must stay finite).
StrictInt = Annotated[int, Strict()]
StrictFloat = Annotated[float, Strict(), AllowInfNan(False)]
StrictBool = Annotated[bool, Strict()]
StrictStr = Annotated[str, Strict()]
NonEmptyStr = Annotated[str, Strict(), Field(min_length=1)]

# Bounds. Every integer and number of the API has a documented range (the CRD carries it as minimum/maximum,
# so the API server refuses what `memfit plan` refuses). The maxima are far beyond any real cluster or model,
# and small enough that the planner's work and arithmetic stay bounded and finite whatever a spec says.
MAX_COUNTER: Final = 2**53 - 1
"""Counters (generations, steps): the largest integer a JSON number holds exactly. Not 2^63 - 1: the API server
reads a schema's maximum as a float64, where that rounds up to 2^63 and overflows (it then refuses every value)."""
MAX_STEPS: Final = 10_000_000
"""Epochs, optimizer steps and checkpoint intervals: ten million."""
MAX_ATTEMPTS: Final = 100
"""Gang restarts and out-of-memory re-plans a job may use."""
MAX_TOLERATION_SECONDS: Final = 10 * 365 * 24 * 3600
"""Ten years."""
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
"""An RFC 1123 subdomain, as Kubernetes names PersistentVolumeClaims and Secrets (at most 253 characters)."""
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
"""An RFC 1123 label, as Kubernetes names namespaces (at most 63 characters)."""
SECRET_KEY = r"^[-._a-zA-Z0-9]+$"
"""A key of a Secret's data."""
MAX_PATH_LENGTH: Final = 4096
"""PATH_MAX on Linux."""

ResourceName = Annotated[str, Strict(), Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN)]
"""The name of a namespaced object the job refers to (PersistentVolumeClaim, Secret)."""


def _inside_the_claim(path: str) -> str:
    """A path on a PersistentVolumeClaim: relative to the claim's root, where a leading `/` is that root too;
    it may not climb out (`..`) nor hold control characters."""
    if any(not character.isprintable() for character in path):
        raise ValueError("control characters are not allowed in a path")
    if ".." in PurePosixPath(path).parts:
        raise ValueError("`..` is not allowed in a path: it must stay inside the claim (a leading `/` is its root)")
    return path


ClaimPath = Annotated[str, Strict(), Field(min_length=1, max_length=MAX_PATH_LENGTH), AfterValidator(_inside_the_claim)]


def _bounded_repr() -> reprlib.Repr:
    bounded = reprlib.Repr()
    bounded.maxlevel, bounded.maxdict, bounded.maxlist, bounded.maxtuple, bounded.maxset = 2, 3, 3, 3, 3
    bounded.maxstring = bounded.maxlong = bounded.maxother = SHOWN_LENGTH
    return bounded


SHOWN_LENGTH: Final = 80
"""How much of a value from the input an error message echoes."""
_BOUNDED_REPR = _bounded_repr()


def shown(value: Any) -> str:
    """A value from the input as an error message may echo it: its repr, control characters and other
    unprintable ones escaped (never interpreted by a terminal), cut to about 80 characters (an alias bomb
    or a megabyte string must not come back in full)."""
    try:
        return escaped(_BOUNDED_REPR.repr(value))
    except Exception:  # a value whose repr fails (an integer past Python's digit limit): its type will do
        return f"<{type(value).__name__}>"


def escaped(text: str) -> str:
    """``text`` with every unprintable character (newlines, escape codes, bidi overrides) written as its
    escape sequence, so that it prints literally on one line."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


ACRONYMS = {"gpu": "GPU", "gpus": "GPUs", "gib": "GiB", "gbps": "GBps", "tflops": "TFLOPS"}
"""Words that keep their capitals inside a camelCase name (maxGPUs, gpuMemoryGiB, peakTFLOPS)."""


def to_camel(name: str) -> str:
    """snake_case -> camelCase as Kubernetes APIs spell it, acronyms included."""
    first, *rest = name.split("_")
    return first + "".join(ACRONYMS.get(word, word.capitalize()) for word in rest)


class ApiModel(BaseModel):
    """camelCase on the wire, snake_case in Python; unknown fields are errors, not silently dropped.

    Validating from Python accepts both spellings (``populate_by_name``); the YAML loader validates with
    ``by_name=False``, so files must use the camelCase names the API server knows."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        use_attribute_docstrings=True,
        validate_default=True,
        allow_inf_nan=False,
    )

    def to_api(self) -> dict[str, Any]:
        """The object as Kubernetes stores it: camelCase keys, unset optional fields left out."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


class SecretKeyRef(ApiModel):
    """A key of a Secret in the job's namespace."""

    name: ResourceName
    """Name of the Secret."""
    key: Annotated[str, Strict(), Field(min_length=1, max_length=253, pattern=SECRET_KEY)] = "token"
    """Key inside the Secret whose value is used."""


class Source(ApiModel):
    """Where files come from: a PersistentVolumeClaim (`pvc` + `path`) or the Hugging Face Hub (`hub`)."""

    pvc: ResourceName | None = None
    """Name of a PersistentVolumeClaim in the job's namespace that holds the files."""
    path: ClaimPath | None = None
    """Path inside the claim, from its root (a leading `/` is the root too; `..` is refused). Defaults to the
    root. Only with `pvc`."""
    hub: Annotated[str, Strict(), Field(min_length=1, max_length=256)] | None = None
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

    pvc: ResourceName
    """Name of a PersistentVolumeClaim in the job's namespace."""
    path: ClaimPath = "/"
    """Directory inside the claim, from its root (a leading `/` is the root too; `..` is refused)."""


class Toleration(ApiModel):
    """A Kubernetes toleration, copied to the trainer pods."""

    key: Annotated[str, Strict(), Field(max_length=316)] | None = None
    """Taint key the toleration applies to; empty matches all keys (with operator Exists)."""
    operator: Literal["Exists", "Equal"] | None = None
    """How the key relates to the value."""
    value: Annotated[str, Strict(), Field(max_length=63)] | None = None
    """Taint value the toleration matches (with operator Equal)."""
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    """Taint effect to match; empty matches all effects."""
    toleration_seconds: Annotated[int, Strict(), Field(ge=0, le=MAX_TOLERATION_SECONDS)] | None = None
    """How long a NoExecute taint is tolerated before eviction (0 to ten years)."""


class Condition(ApiModel):
    """A status condition as the Kubernetes API conventions define it."""

    type: NonEmptyStr
    """Type of condition, e.g. Ready, Planned, Running, Succeeded, Suspended."""
    status: Literal["True", "False", "Unknown"]
    """Whether the condition holds."""
    reason: NonEmptyStr
    """One CamelCase word for machines: why the condition last changed."""
    message: StrictStr = ""
    """A sentence for people: details of the last change."""
    last_transition_time: StrictStr
    """When the condition last changed status (RFC 3339)."""
    observed_generation: Annotated[int, Strict(), Field(ge=0, le=MAX_COUNTER)] | None = None
    """The `.metadata.generation` the condition was set for."""


class _ServerMetadata(ApiModel):
    """The rest of the standard object metadata: fields the API server sets, or that a manifest may hold
    (`kubectl get -o yaml` output, `generateName`). Only checked: memfit keeps them as they are."""

    uid: StrictStr | None = None
    resource_version: StrictStr | None = None
    generation: Annotated[int, Strict(), Field(ge=0, le=MAX_COUNTER)] | None = None
    creation_timestamp: StrictStr | None = None
    deletion_timestamp: StrictStr | None = None
    deletion_grace_period_seconds: Annotated[int, Strict(), Field(ge=0, le=MAX_COUNTER)] | None = None
    finalizers: list[StrictStr] | None = None
    owner_references: list[dict[str, Any]] | None = None
    managed_fields: list[dict[str, Any]] | None = None
    generate_name: StrictStr | None = None
    self_link: StrictStr | None = None


class ObjectMeta(ApiModel):
    """The part of Kubernetes object metadata memfit reads.

    Only the fields of the standard ObjectMeta are accepted (a misspelt `labesl` is an error, as the API
    server's schema makes it). Those memfit does not read (uid, resourceVersion, generation, ...) are checked
    and kept as extra fields, in ``model_extra``."""

    model_config = ConfigDict(extra="allow")

    name: NonEmptyStr
    """Object name: a DNS-1123 subdomain, as the API server requires of a custom resource's name."""
    namespace: StrictStr | None = None
    """Namespace (FineTuneJobs are namespaced; GPUPools are cluster-scoped): a DNS-1123 label."""

    @field_validator("name")
    @classmethod
    def _subdomain(cls, name: str) -> str:
        if len(name) > 253 or not re.fullmatch(DNS_SUBDOMAIN, name):
            raise ValueError(
                f"{shown(name)} is not a valid object name: the API server takes at most 253 lower-case letters, "
                "digits, '-' and '.', beginning and ending with a letter or digit"
            )
        return name

    @field_validator("namespace")
    @classmethod
    def _label(cls, namespace: str | None) -> str | None:
        if namespace is not None and (len(namespace) > 63 or not re.fullmatch(DNS_LABEL, namespace)):
            raise ValueError(
                f"{shown(namespace)} is not a valid namespace: the API server takes at most 63 lower-case "
                "letters, digits and '-', beginning and ending with a letter or digit"
            )
        return namespace

    labels: dict[StrictStr, StrictStr] = Field(default_factory=dict)
    """Labels."""
    annotations: dict[StrictStr, StrictStr] = Field(default_factory=dict)
    """Annotations."""

    @model_validator(mode="before")
    @classmethod
    def _standard_fields_only(cls, data: Any) -> Any:
        if isinstance(data, dict):
            read = {name for name in cls.model_fields}
            _ServerMetadata.model_validate({k: v for k, v in data.items() if k not in read}, by_name=False)
        return data
