"""Auxiliary files (``config.json``, tokenizer files) kept with a step and copied out by materialize.

Files are opaque bytes, stored once each under ``format.layout.file_name(key)`` (key: xxh3-128 of
the bytes), a namespace apart from the tensor blobs so blob verification never mistakes them for
tensors. A step records ``(path, key, size)`` per file in its manifest and catalog rows; the
path is where materialize puts the file, relative to the output directory.

Whoever can write the store can write those rows (the catalog's ``files`` table, a manifest),
so one rule (``refusal``) decides where a file may land, at commit, on import from a manifest
and again on the way out (materialize, export): a canonical relative path that can replace
nothing DeepSpeed writes or reads, so a store never gets a file where DeepSpeed unpickles or a
script runs. What a file holds is judged on the way out too, by content whatever its name
(``pickle_problem``): a directory goes to loaders (accelerate's ``load_state``, ``torch.load``)
that unpickle any file they are pointed at with ``weights_only=False``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from . import knobs
from .errors import BadInputError, CorruptError, NotFoundError, clip
from .format import pickled
from .format.layout import file_name
from .hashing import PLAIN, ContentHash
from .model import FileRow
from .objects import ObjectStore

# Names DeepSpeed writes or reads in a checkpoint directory (``latest_universal`` picks the tag
# of a universal checkpoint; save_checkpoint copies the two scripts in), and the marker that
# says materialize/export wrote a folder (``materialize.outputs``): a file must never take their place.
OUTPUT_MARKER = ".ckptstore-output"
RESERVED = ("latest", "latest_universal", "zero_to_fp32.py", "zero_to_torch.py", OUTPUT_MARKER)

FileSpec = str | os.PathLike | Iterable[str | os.PathLike]
# What collect() found, as (path in the checkpoint directory, local path or the bytes read).
Entries = list[tuple[str, Path | bytes]]


class Read(list):
    """Files already read (``read``): ``collect`` passes them through unchanged, so a commit
    that runs later keeps the contents the files had when it was submitted."""


def file_key(data: bytes, content_hash: ContentHash = PLAIN) -> str:
    """Content key of a file's bytes (32 hex digits) by ``content_hash`` (the store's)."""
    return content_hash.key_of(data)


def collect(files: FileSpec | Read) -> Entries:
    """``(path in the checkpoint directory, local path)`` of every file named by ``files``.

    ``files`` is a directory (every file under it, at its relative path), one file, or a list
    of files and directories (a file keeps its base name). Raises BadInputError for missing
    or oversized files, duplicate names, and names the checkpoint itself uses.
    """
    if isinstance(files, Read):
        return list(files)
    if not isinstance(files, str | os.PathLike | Iterable) or isinstance(files, bytes):
        raise BadInputError(f"files= takes paths or a directory, not {clip(repr(files), 60)}")
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


def refusal(path: object) -> str | None:
    """Why an auxiliary file may not be kept at ``path``, or None if it may: the one rule.

    A path is allowed when it is canonical, relative and POSIX (parts joined by ``/``, none
    empty, ``.`` or ``..``; no backslash or NUL) and its first part is neither a name in
    ``RESERVED`` nor a ``global_step*`` folder. The materialized tag's own folder is refused by
    ``materialize.directory.check_tag``, which can compare first parts exactly because of this.
    """
    if not isinstance(path, str) or not path:
        return "is not a path"
    if "\\" in path or "\0" in path:
        return "holds a backslash or NUL"
    if path.startswith("/"):
        return "is absolute"
    parts = path.split("/")
    if any(part in ("", ".", "..") for part in parts):
        return "is not a canonical relative path (empty, '.' or '..' parts)"
    if parts[0] in RESERVED or parts[0].startswith("global_step"):
        return "would replace part of the DeepSpeed checkpoint"
    return None


def _check_name(name: str) -> None:
    reason = refusal(name)
    if reason:
        raise BadInputError(f"files=: {name} {reason}; rename it")


def read(files: FileSpec) -> Read:
    """``collect(files)`` with every file's bytes read now (a non-blocking commit's files)."""
    return Read((name, source.read_bytes()) for name, source in collect(files))


def store(objects: ObjectStore, entries: Entries) -> list[FileRow]:
    """Store each file once (content-addressed); durable when it returns."""
    rows = []
    for name, source in entries:
        data = source if isinstance(source, bytes) else source.read_bytes()
        key = file_key(data, objects.content_hash)
        if objects.touch(file_name(key)) is None:
            objects.put_if_absent(file_name(key), data)
        rows.append(FileRow(name, key, len(data)))
    return rows


def check_rows(rows: Iterable[FileRow], step: int) -> None:
    """CorruptError naming ``step`` and the path unless every row may be written out: each path
    passes ``refusal``, and no path is another's folder or given twice (rows read from the
    catalog or a manifest are store-supplied, so this runs before anything is written)."""
    seen: set[str] = set()
    for row in rows:
        reason = refusal(row.path)
        if reason is None and row.path in seen:
            reason = "is given twice"
        if reason:
            raise CorruptError(f"step {step} keeps an auxiliary file at {row.path!r}, which {reason}")
        seen.add(row.path)
    for path in seen:
        folders = ["/".join(path.split("/")[:i]) for i in range(1, path.count("/") + 1)]
        clash = next((folder for folder in folders if folder in seen), None)
        if clash:
            raise CorruptError(
                f"step {step} keeps an auxiliary file at {clash!r} and another under it ({path!r})"
            )


def check_record(record) -> None:
    """``check_rows`` of a step record's files (a manifest being imported into a catalog)."""
    check_rows(record.files, record.step)


def pickle_problem(data: bytes) -> str | None:
    """What is wrong with a file holding ``data`` on its way out, or None: a pickle or torch
    archive that needs more than ``torch.load(weights_only=True)`` (``format.pickled``)."""
    reason = pickled.refusal(data)
    return reason and f"holds a pickle that needs more than torch.load(weights_only=True) ({reason})"


def copy_out(
    objects: ObjectStore, rows: Iterable[FileRow], directory: Path, step: int, *, allow_pickle: bool = False
) -> None:
    """Write the recorded files of ``step`` into ``directory``, each verified against its key.

    Raises CorruptError (before writing anything) for a path ``check_rows`` refuses, and for a
    file with a ``pickle_problem`` unless ``allow_pickle`` (whoever can write the store could
    make a loader of the directory run their code; the caller removes what was written). A
    file is created, never replaced, so not even a checkpoint file written before it can be
    overwritten."""
    rows = list(rows)
    check_rows(rows, step)
    for row in rows:
        try:
            data = objects.get(file_name(row.key))
        except NotFoundError:
            raise NotFoundError(f"auxiliary file {row.path} (stored as {row.key}) is missing") from None
        if file_key(data, objects.content_hash) != row.key:
            raise CorruptError(f"auxiliary file {row.path} (stored as {row.key}) is corrupt")
        problem = None if allow_pickle else pickle_problem(data)
        if problem:
            raise CorruptError(
                f"step {step}'s auxiliary file {row.path} {problem}: a loader could run code from it "
                "(if everyone who can write the store is trusted: materialize --allow-pickle)"
            )
        target = directory / row.path
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            with open(target, "xb") as handle:
                handle.write(data)
        except FileExistsError:
            raise CorruptError(
                f"step {step}'s auxiliary file {row.path} would replace a file already written"
            ) from None
