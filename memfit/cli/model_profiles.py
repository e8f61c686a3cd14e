"""The profile of a model directory, for planning a job that types no sizes: from the cache, or made.

Profiling builds the model with ``transformers`` and traces its activations (the trainer package, in a
subprocess: the core never imports torch), which takes up to a minute for a full-size config; the result is
cached by the config's content and the LoRA targets resolved, under ``$MEMFIT_PROFILE_CACHE`` (default
``~/.cache/memfit/profiles``), so that planning the same model again takes milliseconds. A config.json memfit
stores (``memfit.catalog.model_configs``) comes with its profile: nothing is profiled.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from pydantic import ValidationError

from memfit.api.vocabulary import ALL_LINEAR
from memfit.catalog.model_configs import stored_profile_of
from memfit.cli.exit_codes import ExitCode
from memfit.contract.lifetime import tied_environment
from memfit.contract.model_match import CONFIG_FILE, read_model_config
from memfit.profile import PROFILE_VERSION, ModelProfile, canonical_config_sha256

CACHE_ENV = "MEMFIT_PROFILE_CACHE"


class ProfileFailed(Exception):
    """The profiler refused the model (exit 2: bad input) or failed; ``str()`` is its one line."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def make_profile(path: Path, lora_targets: Sequence[str] = (), activations: bool = False) -> str:
    """The profile JSON ``python -m memfit_trainer.profile`` prints for a config.json or its directory."""
    command = [sys.executable, "-m", "memfit_trainer.profile", str(path), "-o", "json"]
    for targets in lora_targets:
        command += ["--lora-targets", targets]
    if activations:
        command.append("--activations")
    # Its own session: a Ctrl-C at the terminal reaches memfit alone, which kills it (subprocess.run does on any
    # exception); tied to this process, it ends with it however this ends (memfit.contract.lifetime).
    done = subprocess.run(
        command, capture_output=True, text=True, check=False, env=tied_environment(), start_new_session=True
    )
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        last = lines[-1] if lines else f"memfit profile: error: exit {done.returncode}"
        if "No module named" in last:
            last = f"profiling a model needs the trainer package (pip install 'memfit[trainer]'): {last}"
        code = ExitCode.BAD_INPUT if done.returncode == ExitCode.BAD_INPUT else ExitCode.INTERNAL_ERROR
        raise ProfileFailed(last.removeprefix("memfit profile: error: "), code)
    return done.stdout.strip()


def _extra_targets(target_modules: Sequence[str]) -> list[str]:
    """The ``--lora-targets`` a job needs resolved beyond ``all-linear`` (which every profile resolves)."""
    return [] if ALL_LINEAR in target_modules else [",".join(sorted(target_modules))]


def cache_directory() -> Path:
    configured = os.environ.get(CACHE_ENV)
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "memfit" / "profiles"


def _cache_file(config_sha256: str, extra: list[str]) -> Path:
    targets = hashlib.sha256("|".join(extra).encode()).hexdigest()[:12]
    return cache_directory() / f"v{PROFILE_VERSION}-{config_sha256}-{targets}.json"


def _cached(file: Path) -> ModelProfile | None:
    """A readable profile of this version, else None (a damaged or older entry is made again)."""
    try:
        return ModelProfile.model_validate_json(file.read_text(encoding="utf-8"))
    except (OSError, ValueError, ValidationError):
        return None


def directory_profile(
    directory: Path, target_modules: Sequence[str], progress: Callable[[str], None] | None = None
) -> ModelProfile:
    """The profile (activations traced, the job's LoRA targets resolved) of the model whose config.json is in
    ``directory``; ``memfit.contract.model_match.ModelDirectoryError`` when there is none, ProfileFailed when it
    cannot be profiled."""
    config = read_model_config(directory)
    extra = _extra_targets(target_modules)
    sha = canonical_config_sha256(config)
    stored = stored_profile_of(sha) if not extra else None
    if stored is not None:
        return stored
    file = _cache_file(sha, extra)
    profile = _cached(file)
    if profile is not None:
        return profile
    if progress is not None:
        progress(f"profiling the model in {directory} from its {CONFIG_FILE} (up to a minute; cached in {file.parent})")
    text = make_profile(directory, extra, activations=True)
    profile = ModelProfile.model_validate_json(text)
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        temporary = file.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(text + "\n", encoding="utf-8")
        temporary.replace(file)
    except OSError as error:
        if progress is not None:
            progress(f"the profile is not cached: {error}")
    return profile
