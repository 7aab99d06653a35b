"""Auxiliary files (``config.json``, tokenizer files) kept with a step and copied out by materialize.

Files are opaque bytes, stored once each under ``format.layout.file_name(key)`` (key: xxh3-128 of
the bytes), a namespace apart from the tensor blobs so blob verification never mistakes them for
tensors. A step records ``(path, key, size)`` per file in its manifest and catalog rows; the
path is where materialize puts the file, relative to the output directory.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path, PurePosixPath

import xxhash

from . import knobs
from .errors import BadInputError, CorruptError, NotFoundError
from .format.layout import file_name
from .model import FileRow
from .objects import ObjectStore

# Names the DeepSpeed writer puts in an output directory: a file must not replace them.
_RESERVED = ("latest", "zero_to_fp32.py", "zero_to_torch.py")

FileSpec = str | os.PathLike | Iterable[str | os.PathLike]
# What collect() found, as (path in the checkpoint directory, local path or the bytes read).
Entries = list[tuple[str, Path | bytes]]


class Read(list):
    """Files already read (``read``): ``collect`` passes them through unchanged, so a commit
    that runs later keeps the contents the files had when it was submitted."""


def file_key(data: bytes) -> str:
    """Content key of a file's bytes (32 hex digits)."""
    return xxhash.xxh3_128(data).hexdigest()


def collect(files: FileSpec | Read) -> Entries:
    """``(path in the checkpoint directory, local path)`` of every file named by ``files``.

    ``files`` is a directory (every file under it, at its relative path), one file, or a list
    of files and directories (a file keeps its base name). Raises BadInputError for missing
    or oversized files, duplicate names, and names the checkpoint itself uses.
    """
    if isinstance(files, Read):
        return list(files)
    given = [files] if isinstance(files, (str, os.PathLike)) else list(files)
    found: dict[str, Path] = {}
    for item in given:
        if not isinstance(item, (str, os.PathLike)):
            raise BadInputError(f"files= takes paths or a directory, not {item!r}")
        path = Path(item)
        if path.is_dir():
            entries = [(p.relative_to(path).as_posix(), p) for p in sorted(path.rglob("*")) if p.is_file()]
        elif path.is_file():
            entries = [(path.name, path)]
        else:
            raise BadInputError(f"files=: {path} is not a file or directory")
        for name, source in entries:
            _check_name(name)
            if name in found:
                raise BadInputError(
                    f"files=: two files would be stored as {name} ({found[name]} and {source})"
                )
            size = source.stat().st_size
            if size > knobs.max_file_bytes():
                raise BadInputError(
                    f"files=: {source} has {size} bytes, more than the {knobs.max_file_bytes()} allowed "
                    "for an auxiliary file (CKPTSTORE_MAX_FILE_BYTES)"
                )
            found[name] = source
    return sorted(found.items())


def _check_name(name: str) -> None:
    parts = PurePosixPath(name).parts
    if parts[0] in _RESERVED or parts[0].startswith("global_step"):
        raise BadInputError(f"files=: {name} would replace part of the DeepSpeed checkpoint; rename it")


def read(files: FileSpec) -> Read:
    """``collect(files)`` with every file's bytes read now (a non-blocking commit's files)."""
    return Read((name, source.read_bytes()) for name, source in collect(files))


def store(objects: ObjectStore, entries: Entries) -> list[FileRow]:
    """Store each file once (content-addressed); durable when it returns."""
    rows = []
    for name, source in entries:
        data = source if isinstance(source, bytes) else source.read_bytes()
        key = file_key(data)
        if objects.touch(file_name(key)) is None:
            objects.put_if_absent(file_name(key), data)
        rows.append(FileRow(name, key, len(data)))
    return rows


def check_rows(rows: Iterable[FileRow]) -> None:
    """Refuse recorded file paths that would escape the output directory (a damaged catalog)."""
    for row in rows:
        path = PurePosixPath(row.path)
        if path.is_absolute() or ".." in path.parts or not path.parts:
            raise CorruptError(f"auxiliary file path {row.path!r} is not a relative path")


def copy_out(objects: ObjectStore, rows: Iterable[FileRow], directory: Path) -> None:
    """Write the recorded files into ``directory``, each verified against its key."""
    rows = list(rows)
    check_rows(rows)
    for row in rows:
        try:
            data = objects.get(file_name(row.key))
        except NotFoundError:
            raise NotFoundError(f"auxiliary file {row.path} (stored as {row.key}) is missing") from None
        if file_key(data) != row.key:
            raise CorruptError(f"auxiliary file {row.path} (stored as {row.key}) is corrupt")
        target = directory / row.path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
