"""Units memfit counts in, defined once."""

from __future__ import annotations

GIB = 1024**3
"""Bytes in a GiB."""
