"""Read FineTuneJobs and GPUPools from YAML files, with one clear message per problem.

The files hold what ``kubectl apply -f`` takes (several documents per file allowed), so the same
files serve the cluster and ``memfit plan``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from memfit.api.base import API_VERSION
from memfit.api.finetunejob import FineTuneJob
from memfit.api.gpupool import GPUPool

KINDS: dict[str, type[BaseModel]] = {"FineTuneJob": FineTuneJob, "GPUPool": GPUPool}


class InputError(ValueError):
    """Bad input: the message names the file, the object and the field."""


@dataclass
class Documents:
    jobs: list[FineTuneJob] = field(default_factory=list)
    pools: list[GPUPool] = field(default_factory=list)


def describe_validation_error(error: ValidationError) -> str:
    """One line per problem: `spec.training.globalBatchSize: must be greater than 0`."""
    lines = []
    for problem in error.errors(include_url=False):
        where = ".".join(str(part) for part in problem["loc"]) or "(object)"
        message = problem["msg"].removeprefix("Value error, ")
        if problem["type"] == "extra_forbidden":
            message = "unknown field (check the spelling; `memfit crd` shows every field)"
        elif problem["type"] == "missing":
            message = "required field is missing"
        elif problem["type"] in ("enum", "literal_error"):
            message = f"{message}, got {problem['input']!r}"
        lines.append(f"{where}: {message}")
    return "; ".join(lines)


def parse_object(document: dict[str, Any], origin: str = "object") -> FineTuneJob | GPUPool:
    """Validate one Kubernetes-style object; raises InputError naming what is wrong."""
    if not isinstance(document, dict):
        raise InputError(f"{origin}: expected a mapping with apiVersion, kind, metadata and spec")
    kind, api_version = document.get("kind"), document.get("apiVersion")
    if kind not in KINDS:
        raise InputError(f"{origin}: kind {kind!r} is not one memfit reads (FineTuneJob, GPUPool)")
    if api_version != API_VERSION:
        raise InputError(f"{origin}: apiVersion must be {API_VERSION}, got {api_version!r}")
    name = (document.get("metadata") or {}).get("name", "?")
    try:
        return KINDS[kind].model_validate(document)  # type: ignore[return-value]
    except ValidationError as error:
        raise InputError(f"{origin}: {kind} {name!r}: {describe_validation_error(error)}") from None


def load_documents(*paths: Path) -> Documents:
    """All FineTuneJobs and GPUPools in the files; empty documents are skipped."""
    found = Documents()
    for path in paths:
        try:
            text = path.read_text()
        except OSError as error:
            raise InputError(f"{path}: cannot read: {error.strerror or error}") from None
        try:
            documents = list(yaml.safe_load_all(text))
        except yaml.YAMLError as error:
            raise InputError(f"{path}: not valid YAML: {error}") from None
        for index, document in enumerate(documents, start=1):
            if document is None:
                continue
            parsed = parse_object(document, f"{path} (document {index})")
            (found.jobs if isinstance(parsed, FineTuneJob) else found.pools).append(parsed)  # type: ignore[arg-type]
    return found
