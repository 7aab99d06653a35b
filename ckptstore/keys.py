"""A store's key: where it comes from (``open(key=...)``, ``CKPTSTORE_KEY_FILE``, ``--key-file``)
and the checks a key file must pass before ckptstore reads it.

A key is at least 32 bytes that only the people allowed to write the store hold. It is read
once per open and kept only as the subkeys ``hashing.ContentHash`` derives; no error, log
line or repr names anything but the file that holds it.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from .errors import BadInputError
from .hashing import MIN_KEY_BYTES, PLAIN, ContentHash

KEY_FILE_VARIABLE = "CKPTSTORE_KEY_FILE"
HOW_TO_PASS = f"pass key=... to ckptstore.open, set {KEY_FILE_VARIABLE}, or give the CLI --key-file"


def read_key_file(path: str | os.PathLike) -> bytes:
    """The key held in the file at ``path``: its bytes exactly (at least 32). BadInputError
    naming the file if it is missing, not a regular file, readable or writable by its group or
    others (``chmod 600`` it), or too short."""
    path = Path(path).expanduser()
    try:
        with open(path, "rb") as handle:
            mode = os.fstat(handle.fileno()).st_mode
            if not stat.S_ISREG(mode):
                raise BadInputError(f"the key file {path} is not a regular file")
            if mode & (stat.S_IRGRP | stat.S_IROTH | stat.S_IWGRP | stat.S_IWOTH):
                raise BadInputError(
                    f"the key file {path} is readable or writable by others (mode {stat.S_IMODE(mode):o}): "
                    f"run `chmod 600 {path}`; anyone who reads the key can forge the store's checkpoints, "
                    "and anyone who writes it can put in a key of their own"
                )
            key = handle.read(1 << 20)
    except OSError as exc:
        raise BadInputError(f"cannot read the key file {path}: {exc.strerror}") from None
    if len(key) < MIN_KEY_BYTES:
        raise BadInputError(
            f"the key file {path} holds {len(key)} bytes; a key is at least {MIN_KEY_BYTES} "
            f"(make one with `head -c 32 /dev/urandom > {path}`)"
        )
    return key


def content_hash_for(key: bytes | bytearray | None) -> ContentHash:
    """The content hash of a store opened with ``key``: keyed when one is given, else when
    ``CKPTSTORE_KEY_FILE`` names a key file (``read_key_file``), else plain. BadInputError for
    a key that is not bytes of at least 32."""
    if key is None:
        path = os.environ.get(KEY_FILE_VARIABLE)
        if not path:
            return PLAIN
        key = read_key_file(path)
    if not isinstance(key, bytes | bytearray) or len(key) < MIN_KEY_BYTES:
        shown = f"{len(key)} bytes" if isinstance(key, bytes | bytearray) else type(key).__name__
        raise BadInputError(f"key= takes bytes, at least {MIN_KEY_BYTES} of them, not {shown}")
    return ContentHash.keyed(bytes(key))
