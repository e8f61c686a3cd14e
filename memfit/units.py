"""Units of memory, each defined once: everything else imports them from here."""

from __future__ import annotations

from typing import Final

GIB: Final = 1024**3
"""Bytes in a GiB (what the API's ``*Gib`` fields and nvidia-smi's sizes count in)."""
