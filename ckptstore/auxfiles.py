"""Auxiliary files (``config.json``, tokenizer files) kept with a step and copied out by materialize.

Files are opaque bytes, stored once each under ``format.layout.file_name(key)`` (key: xxh3-128 of
the bytes), a namespace apart from the tensor blobs so blob verification never mistakes them for
tensors. A step records ``(path, key, size)`` per file in its manifest and catalog rows; the
path is where materialize puts the file, relative to the output directory.

Whoever can write the store can write those rows (the catalog's ``files`` table, a manifest),
so one rule (``refusal``) decides where a file may land, at commit, on import from a manifest
and again on the way out (materialize, export): a canonical relative path that can replace
nothing DeepSpeed writes or reads, so a store never gets a file where DeepSpeed unpickles. A
name Python would run or import (``code_refusal``: ``*.py``, ``*.so``, a package) is refused at
commit and left out on the way out.

What a file holds goes to loaders (accelerate's ``load_state``, ``torch.load``) that unpickle
any file they are pointed at with ``weights_only=False``. So a pickle or torch file is kept as
plain data at commit and written out as ckptstore serializes it (``format.plainfile``); other
bytes go out as they are only where no unpickler can start on them, and are otherwise left out
with a warning, unless the caller trusts everyone who can write the store (``allow_pickle``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from pathlib import Path

from . import knobs, pathnames
from .errors import BadInputError, CorruptError, NotFoundError, clip
from .format import plainfile
from .format.layout import file_name
from .hashing import PLAIN, ContentHash
from .model import FileRow
from .objects import ObjectStore

# Names DeepSpeed writes or reads in a checkpoint directory (``latest_universal`` picks the tag
# of a universal checkpoint; save_checkpoint copies the two scripts in), and the marker that
# says materialize/export wrote a folder (``materialize.outputs``): a file must never take their place.
OUTPUT_MARKER = ".ckptstore-output"
RESERVED = ("latest", "latest_universal", "zero_to_fp32.py", "zero_to_torch.py", OUTPUT_MARKER)
# Names a Python interpreter runs or imports from a folder it starts in or is pointed at:
# modules, extensions, bytecode, ``site``'s path files. A ``.pth`` file is taken where it reads
# as plain data (the Trainer's ``rng_state.pth``): what goes out is then ckptstore's own bytes.
CODE_SUFFIXES = (".py", ".pyc", ".pyo", ".pyw", ".pyd", ".pyz", ".so", ".dylib", ".dll", ".egg", ".whl")
PATH_FILE_SUFFIX = ".pth"

log = logging.getLogger("ckptstore")

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
            _check_code_name(name, source)
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
    reason = pathnames.refusal(path)
    if reason is not None:
        return reason
    parts = path.split("/")
    if parts[0] in RESERVED or parts[0].startswith("global_step"):
        return "would replace part of the DeepSpeed checkpoint"
    return None


def code_refusal(path: str) -> str | None:
    """Why a file at ``path`` (one ``refusal`` allows) is one Python would run or import, or
    None: a module, extension or bytecode, a package's ``__init__``, ``__pycache__``, an
    executable's ``bin/``... name. A ``.pth`` path file is judged with its content
    (``_check_code_name``, ``copy_out``)."""
    parts = path.split("/")
    name = parts[-1].lower()
    if name.endswith(CODE_SUFFIXES) or ".cpython-" in name or "__pycache__" in parts:
        return "is a name Python would import or run"
    if name.split(".")[0] in ("__init__", "__main__", "sitecustomize", "usercustomize"):
        return "is a name Python would import or run"
    return None


def _check_name(name: str) -> None:
    reason = refusal(name)
    if reason:
        raise BadInputError(f"files=: {name} {reason}; rename it")


def _check_code_name(name: str, source: Path) -> None:
    reason = code_refusal(name)
    if reason is None and name.lower().endswith(PATH_FILE_SUFFIX):
        data = source.read_bytes()
        if not plainfile.encode(data, knobs.max_file_bytes()).plain:
            reason = "is a Python path file (.pth) that is not a torch file of plain data"
    if reason:
        raise BadInputError(f"files=: {name} {reason}; rename it or leave it out")


def read(files: FileSpec) -> Read:
    """``collect(files)`` with every file's bytes read now (a non-blocking commit's files)."""
    return Read((name, source.read_bytes()) for name, source in collect(files))


def store(objects: ObjectStore, entries: Entries) -> list[FileRow]:
    """Store each file once (content-addressed), a pickle or torch file as plain data
    (``format.plainfile``); durable when it returns. A file kept as bytes that materialize
    would leave out (``plainfile.opaque_refusal``) is named in a warning."""
    rows = []
    for name, source in entries:
        data = source if isinstance(source, bytes) else source.read_bytes()
        kept = plainfile.encode(data, knobs.max_file_bytes())
        if not kept.plain and (reason := plainfile.opaque_refusal(data)):
            log.warning(
                "ckptstore: the file %s %s and is no pickle of plain data: it is kept as it is, and "
                "materialize leaves it out unless --allow-pickle",
                name,
                reason,
            )
        data = kept.stored
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


def copy_out(
    objects: ObjectStore, rows: Iterable[FileRow], directory: Path, step: int, *, allow_pickle: bool = False
) -> list[str]:
    """Write the recorded files of ``step`` into ``directory`` (mode 0644), each read within
    its recorded size and verified against its key; return the paths left out.

    Raises CorruptError (before writing anything) for a path ``check_rows`` refuses, and for
    a file that does not verify (the caller removes what was written). A file kept as plain
    data goes out as ckptstore serializes it; one kept as bytes goes out as it is where no
    unpickler can start on it, and otherwise (unless ``allow_pickle``) is left out, as is a
    name Python would import, each named in a warning. A file is created, never replaced, so
    not even a checkpoint file written before it can be overwritten."""
    rows = list(rows)
    check_rows(rows, step)
    left_out = []
    for row in rows:
        data = _read(objects, row)
        plain = plainfile.is_plain(data)
        reason = code_refusal(row.path)
        if reason is None and not plain and row.path.lower().endswith(PATH_FILE_SUFFIX):
            reason = "is a Python path file (.pth) that is not plain data"
        if plain:
            data = plainfile.decode(data, f"step {step}'s auxiliary file {row.path}")
        elif reason is None and not allow_pickle and (opaque := plainfile.opaque_refusal(data)):
            reason = f"{opaque}: left out (materialize --allow-pickle writes it)"
        if reason:
            log.warning("ckptstore: step %d's auxiliary file %s %s%s", step, row.path, reason,
                        "" if "left out" in reason else ": left out")  # fmt: skip
            left_out.append(row.path)
            continue
        _write_new(directory / row.path, data, step, row.path)
    return left_out


def plain_data_problem(data: bytes) -> str | None:
    """What is wrong with a stored file's bytes, or None: plain data that does not rebuild
    (``plainfile.decode``). A file kept as bytes has no such problem: materialize may leave
    it out, but nothing is corrupt."""
    if not plainfile.is_plain(data):
        return None
    try:
        plainfile.decode(data, "it")
    except CorruptError as exc:
        return str(exc).removeprefix("it ")
    return None


def _read(objects: ObjectStore, row: FileRow) -> bytes:
    """The stored bytes of ``row``, never more than its recorded size, verified by its key."""
    size = row.size if isinstance(row.size, int) and row.size >= 0 else 0
    try:
        data = bytes(objects.get_range(file_name(row.key), 0, size + 1))
    except NotFoundError:
        raise NotFoundError(f"auxiliary file {row.path} (stored as {row.key}) is missing") from None
    if len(data) != row.size or file_key(data, objects.content_hash) != row.key:
        raise CorruptError(f"auxiliary file {row.path} (stored as {row.key}) is corrupt")
    return data


def _write_new(target: Path, data: bytes, step: int, path: str) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        handle = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except FileExistsError:
        raise CorruptError(
            f"step {step}'s auxiliary file {path} would replace a file already written"
        ) from None
    with open(handle, "wb") as file:
        os.fchmod(file.fileno(), 0o644)  # whatever the umask: data, never executable
        file.write(data)
