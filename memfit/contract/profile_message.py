"""A model profile as a profiling pod's termination message, and back: base64 of the xz-compressed JSON.

The operator profiles a model it is given no sizes for in a short CPU-only pod (``python -m
memfit_trainer.profile ... --termination-log /dev/termination-log``). Kubernetes copies the container's
termination message into the pod's status, at most 4096 bytes: a profile's JSON is 10 to 32 KiB, about 2 to
4 KiB compressed (xz at its strongest preset, about 12% smaller than gzip: Gemma 4's 32 KiB profile fits only
so), so the message is ``base64(xz(JSON))``, which also tells it apart from a ConfigError message (JSON,
``memfit.contract.termination``), the pod's one line when it cannot profile the model. No torch here: the
operator decodes what the trainer package encodes.
"""

from __future__ import annotations

import base64
import binascii
import json
import lzma

from pydantic import ValidationError

from memfit.contract.termination import MAX_TERMINATION_MESSAGE_BYTES
from memfit.profile import ModelProfile


class ProfileMessageError(ValueError):
    """A termination message that is not an encoded profile (``str()`` says why, in one line)."""


def encode_profile_message(profile: ModelProfile) -> str:
    """The termination message holding ``profile``; ProfileMessageError when it would exceed 4096 bytes."""
    text = json.dumps(profile.model_dump(mode="json"), separators=(",", ":"), sort_keys=True)
    packed = base64.b64encode(lzma.compress(text.encode("utf-8"), preset=9 | lzma.PRESET_EXTREME)).decode("ascii")
    if len(packed) > MAX_TERMINATION_MESSAGE_BYTES:
        raise ProfileMessageError(
            f"the profile of {profile.architecture} is {len(packed)} bytes encoded, more than the "
            f"{MAX_TERMINATION_MESSAGE_BYTES} bytes a termination message holds"
        )
    return packed


def decode_profile_message(message: str) -> ModelProfile:
    """The profile in a termination message written by :func:`encode_profile_message`."""
    try:
        text = lzma.decompress(base64.b64decode(message.strip(), validate=True))
    except (binascii.Error, ValueError, lzma.LZMAError) as error:
        raise ProfileMessageError(f"not an encoded profile ({error})") from error
    try:
        return ModelProfile.model_validate_json(text)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "the profile"
        raise ProfileMessageError(f"not a profile memfit reads ({where}: {first['msg']})") from error
