"""The error hierarchy: every failure ckptstore reports is one of these.

Each class carries a stable exit code so scripts and cron can tell "no such step" from
"corruption" without parsing messages. Backends translate OS and botocore errors into these
and mark them transient (worth retrying) or permanent.
"""

from __future__ import annotations

import errno
import re


class CkptStoreError(Exception):
    """Base of every ckptstore error; ``exit_code`` is what the CLI exits with."""

    exit_code = 10
    transient = False


class NotFoundError(CkptStoreError):
    """A step, layer, blob, store or file that was asked for does not exist."""

    exit_code = 3


class CorruptError(CkptStoreError):
    """Stored bytes do not match their key, or cannot be parsed."""

    exit_code = 4


class ConflictError(CkptStoreError):
    """The request conflicts with what the store already holds (e.g. step already committed)."""

    exit_code = 5


class UnsupportedError(CkptStoreError):
    """The engine, optimizer, store format or schema is one ckptstore cannot handle."""

    exit_code = 6


class BadInputError(CkptStoreError):
    """An argument, URI or spec given by the user is invalid."""

    exit_code = 2


class WeightsOnlyError(CkptStoreError):
    """The step keeps only its weights (gc made it weights-only): it exports, it does not resume."""

    exit_code = 8


class StorageError(CkptStoreError):
    """The object store failed (disk full, permission denied, network)."""

    exit_code = 7

    def __init__(self, message: str, *, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient


def require_int(value: object, what: str, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` if it is an integer of at least ``minimum`` and at most ``maximum``, else
    BadInputError saying ``"<what> must be <kind>, not <value>"``. A bool is not an integer here."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or (minimum is not None and value < minimum)
        or (maximum is not None and value > maximum)
    ):
        kind = {None: "an integer", 0: "a non-negative integer", 1: "a positive integer"}.get(
            minimum, f"an integer >= {minimum}"
        )
        if maximum is not None:
            kind = f"{kind} up to {maximum}"
        raise BadInputError(f"{what} must be {kind}, not {clip(repr(value), 40)}")
    return value


# Out of space, quota, file size limit and permission problems do not go away by retrying.
PERMANENT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EACCES, errno.EPERM, errno.EROFS}

_REASONS = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EFBIG: "file too large (a file size limit, ulimit -f)",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EROFS: "read-only file system",
}


def storage_error(action: str, what: object, exc: OSError) -> StorageError:
    """The StorageError for ``exc``, raised while trying to ``action`` ``what`` (a path or an
    object's name): ``"cannot <action> <what>: <reason>"``, transient unless the errno is one
    retrying cannot fix (PERMANENT_ERRNOS)."""
    reason = _REASONS.get(exc.errno) or exc.strerror or str(exc)
    return StorageError(
        f"cannot {action} {clip(str(what), 200)}: {clip(reason)}", transient=exc.errno not in PERMANENT_ERRNOS
    )


# ``scheme://user:password@host``: the userinfo part of a URL (never printed).
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/@\s'\"]*@")


def redact(text: str) -> str:
    """``text`` with the userinfo (``user:password@``) of every URL in it removed."""
    return _USERINFO.sub(r"\1", text)


def clip(text: str, limit: int = 160) -> str:
    """``text`` cut to about ``limit`` characters: for quoting what a stored object says (a name,
    a parser's complaint) in an error, which must stay one readable line whatever the object holds."""
    return text if len(text) <= limit else f"{text[: limit - 12]}... ({len(text)} chars)"
