"""Read FineTuneJobs and GPUPools from YAML files, with one clear message per problem.

The files hold what ``kubectl apply -f`` takes (several documents per file allowed), so the same
files serve the cluster and ``memfit plan``. They are read as strictly as the API server's structural
schema reads them, and a hostile file gets a one-line refusal rather than a crash, a hang or a flood:

* UTF-8 only (a UTF-8 byte-order mark is allowed), at most ``MAX_FILE_BYTES`` and ``MAX_DOCUMENTS``.
* No YAML aliases (``*name``, so no ``<<: *base`` merges either): Kubernetes manifests never need them
  (kubectl accepts them, but every alias is a copy the reader must expand, and a few lines of nested
  aliases expand to gigabytes: the "billion laughs"). Anchors alone are harmless and ignored.
* Collections nested at most ``MAX_DEPTH`` deep (a manifest needs about 15 at most).
* Integers must fit in 64 bits, as Kubernetes stores them.
* A key given twice in one mapping is an error naming it and its line (YAML requires unique keys; plain
  PyYAML silently keeps the last one).
* Numbers are read as YAML 1.2 and kubectl read them (`2e-5` is a number; PyYAML's YAML 1.1 makes it a
  string); timestamps stay strings, as Kubernetes reads them; the !!binary, !!set, !!omap, !!pairs and
  !!timestamp tags are refused, since JSON, and so the API, has no such values.

Every value an error message echoes is cut to about 80 characters with control characters escaped
(:func:`memfit.api.base.shown`).
"""

from __future__ import annotations

import codecs
import difflib
import re
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import yaml
from pydantic import BaseModel, ValidationError
from yaml.composer import Composer, ComposerError
from yaml.constructor import ConstructorError, SafeConstructor
from yaml.events import AliasEvent
from yaml.nodes import MappingNode, Node, ScalarNode
from yaml.parser import Parser
from yaml.reader import Reader
from yaml.resolver import Resolver
from yaml.scanner import Scanner

from memfit.api.base import API_VERSION, SHOWN_LENGTH, escaped, shown
from memfit.api.finetunejob import FineTuneJob
from memfit.api.gpupool import GPUPool

KINDS: dict[str, type[BaseModel]] = {"FineTuneJob": FineTuneJob, "GPUPool": GPUPool}

MAX_FILE_BYTES: Final = 4 * 1024 * 1024
"""The largest file read (the API server refuses objects over about 1.5 MiB anyway)."""
MAX_DOCUMENTS: Final = 1000
"""Documents (objects) per file."""
MAX_DEPTH: Final = 32
"""Nesting of YAML collections."""
MAX_NODES: Final = 100_000
"""YAML values (scalars and collections) in one file: a thousand GPUPools hold about 40000. Bounds the time
spent reading: about ten microseconds each."""
MAX_PROBLEMS: Final = 3
"""Validation problems named in one message (the count of the rest follows)."""
MAX_MESSAGE: Final = 400
"""Characters of one problem's message."""
_INT64 = range(-(2**63), 2**63)
_MAX_INT_CHARS = 100
"""An int64 written in binary with sign, prefix and a few underscores is shorter."""
_REFUSED_TAGS = ("binary", "set", "omap", "pairs", "timestamp")


class InputError(ValueError):
    """Bad input: the message names the file, the object and the field."""


@dataclass
class Documents:
    jobs: list[FineTuneJob] = field(default_factory=list)
    pools: list[GPUPool] = field(default_factory=list)


class _Strictness(Composer, SafeConstructor, Resolver):
    """PyYAML's safe loading with the limits of the module docstring; the events come from a parser class
    beside it (libyaml's where PyYAML has it: it scans a few MiB in milliseconds, the pure-Python one takes
    seconds)."""

    positions_in_bytes = False
    """Whether the parser reports a bad character's position in UTF-8 bytes (libyaml) or characters."""

    if TYPE_CHECKING:  # from the parser beside it

        def check_event(self, *choices: Any) -> bool: ...
        def peek_event(self) -> Any: ...
        def dispose(self) -> None: ...

    def __init__(self) -> None:
        Composer.__init__(self)
        SafeConstructor.__init__(self)
        Resolver.__init__(self)
        self._depth = 0
        self._nodes = 0

    def compose_node(self, parent: Node | None, index: int) -> Node | None:
        if self.check_event(AliasEvent):
            event = self.peek_event()
            raise ComposerError(
                None, None, f"found alias *{event.anchor}: YAML aliases are not accepted, write the value out",
                event.start_mark,
            )  # fmt: skip
        self._depth += 1
        self._nodes += 1
        try:
            if self._depth > MAX_DEPTH:
                raise ComposerError(None, None, f"nested more than {MAX_DEPTH} deep", self.peek_event().start_mark)
            if self._nodes > MAX_NODES:
                raise ComposerError(
                    None, None, f"more than {MAX_NODES} values in the file", self.peek_event().start_mark
                )
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Hashable, Any]:
        if isinstance(node, MappingNode):  # the base class refuses anything else
            seen: set[Any] = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=deep)
                try:
                    duplicate = key in seen
                except TypeError:  # unhashable: the base class says so
                    continue
                if duplicate:
                    raise ConstructorError(None, None, f"duplicate key {shown(key)}", key_node.start_mark)
                seen.add(key)
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node: ScalarNode) -> int:
        text = self.construct_scalar(node)
        if len(text) > _MAX_INT_CHARS:
            raise ConstructorError(None, None, "integer too large: it must fit in 64 bits", node.start_mark)
        value = super().construct_yaml_int(node)
        if value not in _INT64:
            raise ConstructorError(None, None, f"integer {value} does not fit in 64 bits", node.start_mark)
        return int(value)

    def refuse_tag(self, node: Node) -> None:
        raise ConstructorError(None, None, f"the tag {node.tag} is not accepted (JSON has no such value)",
                               node.start_mark)  # fmt: skip


_Strictness.yaml_constructors = {
    **SafeConstructor.yaml_constructors,
    "tag:yaml.org,2002:int": _Strictness.construct_yaml_int,
    **{f"tag:yaml.org,2002:{tag}": _Strictness.refuse_tag for tag in _REFUSED_TAGS},
}
_Strictness.yaml_implicit_resolvers = {
    first: [(tag, pattern) for tag, pattern in resolvers if tag != "tag:yaml.org,2002:timestamp"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
# YAML 1.2 (and kubectl) read `2e-5` and `1e9` as numbers; YAML 1.1, and so PyYAML, as strings.
_Strictness.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789")
)


class PureStrictLoader(_Strictness, Reader, Scanner, Parser):
    """The limits over PyYAML's pure-Python parser."""

    def __init__(self, stream: str) -> None:
        Reader.__init__(self, stream)
        Scanner.__init__(self)
        Parser.__init__(self)
        _Strictness.__init__(self)


new_loader: Callable[[str], _Strictness] = PureStrictLoader
"""The loader ``load_documents`` uses: over libyaml where PyYAML was built with it."""

if yaml.__with_libyaml__:
    from yaml._yaml import CParser

    class LibyamlStrictLoader(_Strictness, CParser):
        """The limits over libyaml's parser (its events; composing stays in Python, where the limits are)."""

        positions_in_bytes = True

        def __init__(self, stream: str) -> None:
            CParser.__init__(self, stream)
            _Strictness.__init__(self)

    new_loader = LibyamlStrictLoader


def _cut(text: str, limit: int) -> str:
    text = escaped(text[: limit * 4])
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _field(location: tuple[int | str, ...]) -> str:
    """`spec.tolerations.0.key`: a key from the input (an unknown field) is cut short and escaped."""
    return ".".join(_cut(str(part), SHOWN_LENGTH) for part in location)


def _message(text: str) -> str:
    return _cut(text, MAX_MESSAGE)


def _model_at(model: type[BaseModel], location: tuple[int | str, ...]) -> type[BaseModel] | None:
    """The model class whose fields are at ``location`` under ``model`` (list indices and map keys skipped)."""
    for part in location:
        if not isinstance(part, str):
            continue
        field_info = next((f for n, f in model.model_fields.items() if part in (f.alias, n)), None)
        if field_info is None:
            continue  # a key of a map: its values' model is the one already in hand
        inner = _model_in(field_info.annotation)
        if inner is None:
            return None
        model = inner
    return model


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model an annotation holds (under Optional, Annotated, list or dict), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for argument in getattr(annotation, "__args__", ()):
        found = _model_in(argument)
        if found is not None:
            return found
    return None


def did_you_mean(model: type[BaseModel] | None, location: tuple[int | str, ...]) -> str:
    """`; did you mean `globalBatchSize`?` for an unknown field at ``location`` (a config.json snake_case key
    read as its camelCase field), or nothing."""
    parent = _model_at(model, location[:-1]) if model is not None else None
    unknown = location[-1] if location else None
    if parent is None or not isinstance(unknown, str):
        return ""
    known = [f.alias or n for n, f in parent.model_fields.items()]
    synonyms: dict[str, str] = getattr(parent, "CONFIG_JSON_NAMES", {})
    camel = re.sub(r"_([a-z0-9])", lambda m: m.group(1).upper(), unknown)
    guess = synonyms.get(unknown) or (camel if camel in known else None)
    if guess is None:
        close = difflib.get_close_matches(camel, known, n=1, cutoff=0.75)
        guess = close[0] if close else None
    return f"; did you mean `{guess}`?" if guess else ""


def describe_validation_error(error: ValidationError, model: type[BaseModel] | None = None) -> str:
    """One line for the first few problems: `spec.training.globalBatchSize: must be greater than 0`.
    Values from the input are echoed cut short, with control characters escaped; an unknown field of
    ``model`` gets the field it probably meant."""
    lines = []
    problems = error.errors(include_url=False)
    for problem in problems[:MAX_PROBLEMS]:
        where = _field(problem["loc"]) or "(object)"
        message = problem["msg"].removeprefix("Value error, ")
        if problem["type"] == "extra_forbidden":
            hint = did_you_mean(model, problem["loc"])
            message = f"unknown field{hint or ' (check the spelling; `memfit crd` shows every field)'}"
        elif problem["type"] == "missing":
            message = "required field is missing"
        elif problem["type"] not in ("value_error", "assertion_error"):
            message = f"{message}, got {shown(problem['input'])}"
        lines.append(f"{where}: {_message(message)}")
    if len(problems) > MAX_PROBLEMS:
        lines.append(f"and {len(problems) - MAX_PROBLEMS} more problem(s)")
    return "; ".join(lines)


def parse_object(document: Any, origin: str = "object") -> FineTuneJob | GPUPool:
    """Validate one Kubernetes-style object; raises InputError naming what is wrong."""
    if not isinstance(document, dict):
        raise InputError(
            f"{origin}: expected a mapping with apiVersion, kind, metadata and spec, got {shown(document)}"
        )
    kind, api_version = document.get("kind"), document.get("apiVersion")
    if "kind" not in document:
        raise InputError(f"{origin}: kind: required field is missing (FineTuneJob or GPUPool)")
    if not isinstance(kind, str) or kind not in KINDS:
        raise InputError(f"{origin}: kind {shown(kind)} is not one memfit reads (FineTuneJob, GPUPool)")
    if api_version != API_VERSION:
        raise InputError(f"{origin}: {kind}: apiVersion must be {API_VERSION}, got {shown(api_version)}")
    metadata = document.get("metadata")
    name = metadata.get("name") if isinstance(metadata, dict) else None
    what = f"{kind} {shown(name)}" if isinstance(name, str) and name else kind
    try:
        return KINDS[kind].model_validate(document, by_alias=True, by_name=False)  # type: ignore[return-value]
    except ValidationError as error:
        raise InputError(f"{origin}: {what}: {describe_validation_error(error, KINDS[kind])}") from None


def _text(path: Path, where: str) -> str:
    try:
        with path.open("rb") as file:
            data = file.read(MAX_FILE_BYTES + 1)
    except OSError as error:
        raise InputError(f"{where}: cannot read: {escaped(error.strerror or str(error))}") from None
    if len(data) > MAX_FILE_BYTES:
        raise InputError(f"{where}: larger than {MAX_FILE_BYTES // 2**20} MiB: not a manifest memfit reads")
    for bom, encoding in ((codecs.BOM_UTF32_LE, "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32"),
                          (codecs.BOM_UTF16_LE, "UTF-16"), (codecs.BOM_UTF16_BE, "UTF-16")):  # fmt: skip
        if data.startswith(bom):
            raise InputError(f"{where}: the file is {encoding} text: save it as UTF-8")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        raise InputError(
            f"{where}: line {line}: not UTF-8 text (byte 0x{data[error.start]:02x} at offset {error.start}): "
            "save the file as UTF-8"
        ) from None


def _yaml_problem(error: yaml.YAMLError, text: str) -> str:
    if isinstance(error, yaml.MarkedYAMLError) and error.problem_mark is not None:
        mark = error.problem_mark
        context = f" ({error.context})" if error.context else ""
        return f"line {mark.line + 1}, column {mark.column + 1}: {error.problem}{context}"
    if isinstance(error, yaml.reader.ReaderError) and isinstance(error.position, int):
        line = text.count("\n", 0, error.position) + 1
        character = shown(chr(error.character)) if isinstance(error.character, int) else shown(error.character)
        return f"line {line}: the character {character} is not allowed in YAML"
    return str(error)


def _documents(text: str) -> Iterator[Any]:
    """The documents of a YAML stream, one at a time (what lies past a limit is never parsed)."""
    loader = new_loader(text)
    try:
        while loader.check_data():  # type: ignore[no-untyped-call]
            yield loader.get_data()
    except yaml.reader.ReaderError as error:
        if loader.positions_in_bytes and isinstance(error.position, int):  # libyaml counts UTF-8 bytes
            error.position = len(text.encode()[: error.position].decode(errors="ignore"))
        raise
    finally:
        loader.dispose()


def load_documents(*paths: Path) -> Documents:
    """All FineTuneJobs and GPUPools in the files; empty documents are skipped. Two objects of one kind with one
    name (and namespace) are refused, as the cluster would keep only the last one applied."""
    found = Documents()
    declared: dict[tuple[str, str, str], str] = {}
    for path in paths:
        where = escaped(str(path))
        text = _text(path, where)
        index = 0
        try:
            for index, document in enumerate(_documents(text), start=1):
                if index > MAX_DOCUMENTS:
                    raise InputError(f"{where}: more than {MAX_DOCUMENTS} documents")
                if document is None:
                    continue
                origin = f"{where} (document {index})"
                parsed = parse_object(document, origin)
                _declared_once(declared, parsed, origin)
                (found.jobs if isinstance(parsed, FineTuneJob) else found.pools).append(parsed)  # type: ignore[arg-type]
        except yaml.YAMLError as error:
            raise InputError(f"{where}: not valid YAML: {_message(_yaml_problem(error, text))}") from None
        except RecursionError:  # a guard behind MAX_DEPTH
            raise InputError(f"{where} (document {index + 1}): nested too deep") from None
    return found


def _declared_once(declared: dict[tuple[str, str, str], str], parsed: FineTuneJob | GPUPool, origin: str) -> None:
    """InputError when an object of ``parsed``'s kind, name and namespace was declared before (at ``declared``)."""
    kind = type(parsed).__name__
    meta = parsed.metadata
    namespace = (meta.namespace or "default") if isinstance(parsed, FineTuneJob) else ""
    key = (kind, namespace, meta.name)
    if key in declared:
        place = f" in namespace {escaped(namespace)}" if namespace else ""
        raise InputError(
            f"{origin}: {kind} {shown(meta.name)}{place} is declared twice (first in {declared[key]}); "
            "the cluster would keep only the last one applied: rename one"
        )
    declared[key] = origin
