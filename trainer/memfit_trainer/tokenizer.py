"""Tokenizers: a byte-level one built in code for tiny models, loading a real model's tokenizer, and the
check that a tokenizer fits the model.

Tests and examples train tiny random models and must run offline, so their tokenizer is constructed from
nothing (no file, no download). Real runs load the model's own tokenizer from a local path or the hub; the
hub token comes from an environment variable (a Kubernetes Secret), never from the job's config.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from memfit.contract.sections import ModelConfig
from memfit.contract.termination import one_line

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
BYTE_VOCAB_SIZE = 256
DEFAULT_TOKEN_ENV = "HF_TOKEN"


class TokenizerLoadError(RuntimeError):
    """A tokenizer could not be loaded; the message says where it looked and what to check."""


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map, which the ``ByteLevel`` pre-tokenizer emits."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(BYTE_VOCAB_SIZE):
        if b not in chars:
            chars[b] = chr(BYTE_VOCAB_SIZE + extra)
            extra += 1
    return chars


def byte_level_tokenizer() -> Any:
    """A deterministic byte-level tokenizer: token id == byte value, then ``<|endoftext|>`` and ``<|pad|>``.

    Every string round-trips (any UTF-8 byte is a token), ids depend on nothing but this code, and the
    vocabulary (258) fits any tiny test model with ``vocab_size >= 258``. It has no chat template, so chat
    data uses the documented fallback rendering in :mod:`memfit_trainer.data`.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = _bytes_to_unicode()
    vocab = {byte_chars[b]: b for b in range(BYTE_VOCAB_SIZE)}
    # No merges and no regex split: every byte stays its own token, whatever the text.
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([EOS_TOKEN, PAD_TOKEN])
    # The tokenizer classes of transformers have unannotated constructors.
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=backend, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN
    )


def hub_miss(name_or_path: str, token_env: str, offline: bool) -> str:
    """Why a Hub id did not load and what to do, said alike for the tokenizer and the model's config (the
    token only as set or not)."""
    where = "in the local hub cache (offline mode)" if offline else "reachable on the hub"
    return (
        f"{name_or_path!r} is not a local path and is not {where} (token from ${token_env}: "
        f"{'set' if os.environ.get(token_env) else 'not set'}); without network access, pre-download it into the "
        "image or a volume and pass that directory; for a gated or private model set the token variable"
    )


def load_tokenizer(
    name_or_path: str,
    token_env: str = DEFAULT_TOKEN_ENV,
    revision: str | None = None,
    local_files_only: bool = False,
) -> Any:
    """The tokenizer of a real model, from a local directory or a hub id.

    The hub token is read from the environment variable ``token_env`` (unset means anonymous).
    ``local_files_only`` (or ``HF_HUB_OFFLINE=1``) makes a hub id resolve from the local cache only, failing at
    once instead of after about a minute of retries when there is no network. A tokenizer without a pad token
    gets its EOS token as pad, as causal-LM fine-tuning does everywhere.
    """
    from huggingface_hub import is_offline_mode
    from transformers import AutoTokenizer

    local = Path(name_or_path).expanduser()
    is_local = local.exists()
    if not is_local and name_or_path.startswith(("/", ".", "~")):
        raise TokenizerLoadError(f"tokenizer path {name_or_path!r} does not exist")
    token = None if is_local else os.environ.get(token_env) or None
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            str(local) if is_local else name_or_path,
            token=token,
            revision=revision,
            local_files_only=local_files_only,
        )
    except (OSError, ValueError) as exc:
        if is_local:
            hint = f"the directory {str(local)!r} has no loadable tokenizer (tokenizer.json, tokenizer_config.json)"
        else:
            hint = hub_miss(name_or_path, token_env, offline=local_files_only or is_offline_mode())
        raise TokenizerLoadError(f"cannot load tokenizer: {hint}: {one_line(exc)}") from exc
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def check_vocabulary(tokenizer: Any, vocab_size: int) -> None:
    """Refuse a tokenizer whose ids reach past the model's embedding table: the first such id would index
    out of range in the middle of training (an opaque CUDA assert), not at start."""
    ids = len(tokenizer)
    if ids > vocab_size:
        raise TokenizerLoadError(
            f"the tokenizer ({getattr(tokenizer, 'name_or_path', '') or 'built-in'}) has {ids} token ids but the "
            f"model's vocabSize is {vocab_size}: use the model's own tokenizer, or a model with vocabSize >= {ids}"
        )


def model_tokenizer(model: ModelConfig) -> Any:
    """``model.tokenizer`` where set, else the model's own; a random-init model without one uses the built-in
    byte-level tokenizer. Refused when its ids do not fit the model's embedding (``vocab_size``)."""
    if model.tokenizer is None and model.random_init:
        tokenizer = byte_level_tokenizer()
    else:
        revision = model.revision if model.tokenizer is None else None  # the revision is the model's
        tokenizer = load_tokenizer(model.tokenizer or model.name_or_path, token_env=model.token_env, revision=revision)
    if model.architecture is not None:
        check_vocabulary(tokenizer, model.architecture.vocab_size)
    return tokenizer
