"""Internal constants, each overridable by a ``CKPTSTORE_*`` environment variable.

Tests use the overrides to force edge cases (tiny thresholds, one thread) in small runs.
"""

from __future__ import annotations

import os


def _int(name: str, default: int) -> int:
    value = os.environ.get(f"CKPTSTORE_{name}")
    return default if value is None else int(value)


def _float(name: str, default: float) -> float:
    value = os.environ.get(f"CKPTSTORE_{name}")
    return default if value is None else float(value)


def zstd_level() -> int:
    """zstd compression level for blob payloads (1 is fast and keeps most of the gain)."""
    return _int("ZSTD_LEVEL", 1)


def min_compress_ratio() -> float:
    """Store a payload raw unless zstd shrinks it below this fraction of its size."""
    return _float("MIN_COMPRESS_RATIO", 0.97)


def io_threads() -> int:
    """Threads that hash, compress and write (or fetch and decode) blobs in parallel."""
    return _int("IO_THREADS", max(2, min(8, os.cpu_count() or 2)))


def tmp_suffix() -> str:
    """Suffix of in-flight local writes; listings never show these names."""
    return ".tmp"


def gc_grace_seconds() -> float:
    """Unreferenced blobs younger than this are never swept (a commit may be writing them)."""
    return _float("GC_GRACE", 3600.0)
