"""The object-store interface blobs and manifests are kept in, and the URI -> backend choice.

Names are slash-separated relative keys such as ``blobs/ab/ab12...``. Writes are create-only
(``put_if_absent``): content-addressed objects never change once written, so a second writer
of the same key is told the object is already there.
"""

from __future__ import annotations

import abc
import bisect
import contextlib
import io
import os
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import urlparse

from ..errors import BadInputError
from ..hashing import PLAIN, ContentHash


@dataclass(frozen=True)
class ObjectInfo:
    """Size in bytes and modification time (seconds since the epoch) of a stored object."""

    name: str
    size: int
    mtime: float


@dataclass(frozen=True)
class FileRange:
    """``length`` bytes of the open file descriptor ``fd`` from byte ``offset``: a part of an
    object's data that a backend copies from the file (a commit's pack, spilled to disk as it
    was encoded) without the process ever holding it in memory. The caller keeps ``fd`` open
    until ``put_if_absent`` returns."""

    fd: int
    offset: int
    length: int


Data = bytes | memoryview | list
"""An object's bytes: one buffer, or a list of parts laid end to end (buffers, ``FileRange``s)."""


def part_size(part: bytes | memoryview | FileRange) -> int:
    """Bytes in one part of ``Data``."""
    return part.length if isinstance(part, FileRange) else memoryview(part).nbytes


def data_size(data: Data) -> int:
    """Bytes in ``data``."""
    parts = data if isinstance(data, list) else [data]
    return sum(part_size(part) for part in parts)


def joined(data: Data) -> bytes | memoryview:
    """``data`` as one buffer (a list's parts copied together once); buffers only: a
    ``FileRange`` is streamed (``DataReader``), never joined."""
    return b"".join(data) if isinstance(data, list) else data


class DataReader(io.RawIOBase):
    """``Data`` as a seekable binary file, reading file ranges as it goes: how an upload streams
    an object whose parts lie partly on disk (a request body, a multipart upload's source)
    holding no more of it in memory than the reads ask for."""

    def __init__(self, data: Data) -> None:
        self._parts = data if isinstance(data, list) else [data]
        self._starts = []
        position = 0
        for part in self._parts:
            self._starts.append(position)
            position += part_size(part)
        self._size = position
        self._position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._size}[whence]
        self._position = max(0, base + offset)
        return self._position

    def readinto(self, buffer) -> int:
        out = memoryview(buffer).cast("B")
        filled = 0
        index = bisect.bisect_right(self._starts, self._position) - 1  # the part holding the position
        while filled < out.nbytes and 0 <= index < len(self._parts) and self._position < self._size:
            part, start = self._parts[index], self._starts[index]
            within = self._position - start
            count = min(part_size(part) - within, out.nbytes - filled)
            if count > 0:
                if isinstance(part, FileRange):
                    chunk = os.pread(part.fd, count, part.offset + within)
                    if len(chunk) != count:
                        raise OSError(f"file range of {part.length} bytes ends early")
                else:
                    chunk = memoryview(part).cast("B")[within : within + count]
                out[filled : filled + count] = chunk
                filled += count
                self._position += count
            index += 1
        return filled


class ObjectStore(abc.ABC):
    """A flat namespace of immutable named byte strings."""

    uri: str
    #: Reads copy from the local page cache (CPU work) rather than wait on a network.
    reads_are_local: bool = False
    #: Where a writer spills an object's parts before storing them (``FileRange``): beside the
    #: objects for a local directory, so copying them is cheap; None: the system's temp dir.
    spill_directory: str | None = None
    #: The hash the store names content by (``ckptstore.hashing``); every reader and writer of
    #: content keys takes it from here. Keyed for a store opened with its key.
    content_hash: ContentHash = PLAIN

    @abc.abstractmethod
    def put_if_absent(self, name: str, data: Data, *, single_request: bool = False) -> bool:
        """Store ``data`` under ``name`` unless it exists; True if this call created it.

        ``data`` is one buffer, or a list of parts that make the object in order (a blob's
        header and byte planes, written without first joining them; ``FileRange``s copied
        from a file, never read into memory whole). When it returns, the
        object is durable (fsynced / acknowledged by the server). An existing object is left
        as it is (its time is freshened so a concurrent gc treats it as new).
        ``single_request`` writes the object in one create-only request however large it is,
        never in parts: what a commit point needs, since a real S3-compatible server was seen
        to let two racing multipart completions with ``If-None-Match`` both succeed.
        """

    @abc.abstractmethod
    def touch(self, name: str) -> int | None:
        """Freshen an existing object's time (for the gc grace period) and return its size in
        bytes; None if it does not exist. A reused blob then needs no second request for its size."""

    @abc.abstractmethod
    def get(self, name: str) -> bytes:
        """The object's bytes; raises NotFoundError if it does not exist."""

    @abc.abstractmethod
    def get_range(self, name: str, start: int, length: int) -> bytes | memoryview:
        """``length`` bytes of the object from byte ``start`` (fewer where it ends first; none
        past its end): one entry of a pack without the rest. NotFoundError if it does not exist.
        Read-only; a local store maps long ranges instead of copying them."""

    @abc.abstractmethod
    def info(self, name: str) -> ObjectInfo:
        """Size and time of the object; raises NotFoundError if it does not exist."""

    def exists(self, name: str) -> bool:
        """Whether ``name`` exists."""
        from ..errors import NotFoundError

        try:
            self.info(name)
        except NotFoundError:
            return False
        return True

    @abc.abstractmethod
    def delete(self, name: str) -> None:
        """Remove the object; deleting a missing object is not an error."""

    #: How many names ``delete_many`` takes in one request (S3's DeleteObjects: 1000).
    delete_batch: int = 1000

    def delete_many(self, names: list[str]) -> None:
        """Remove every object named (missing ones are not an error), in as few requests as
        the backend allows; at most ``delete_batch`` names a call."""
        for name in names:
            self.delete(name)

    def lock(self, *, exclusive: bool) -> contextlib.AbstractContextManager:
        """Hold the store's gc lock: shared while committing, exclusive while collecting garbage.

        Backends without a lock primitive return a no-op; there gc relies on the grace period
        and on writers freshening the objects they reuse.
        """
        return contextlib.nullcontext()

    @abc.abstractmethod
    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every finished object whose name starts with ``prefix`` (in-flight writes are never listed)."""

    def list_temporary(self) -> Iterator[ObjectInfo]:
        """Unfinished writes: in flight, or left by a writer that was killed (never listed by
        ``list``). gc deletes those older than its grace period (``delete_temporary``); verify
        counts them. None by default: a backend whose writes leave nothing behind."""
        return iter(())

    def delete_temporary(self, names: list[str]) -> None:
        """Remove the unfinished writes ``list_temporary`` named (gone ones are not an error).
        By default there are none, so every name is already gone: nothing to do."""
        return None

    def local_only(self) -> contextlib.AbstractContextManager:
        """Within it, this thread reads only what this node holds: a local tier does not ask the
        store behind it (a commit never waits on the network, nor fails with it). Other
        backends have nothing behind them: a no-op."""
        return contextlib.nullcontext()

    def at_hand(self, name: str) -> bool:
        """Whether this thread may read ``name`` now without asking further than ``local_only``
        allows; True outside it. A catalog imports only manifests at hand."""
        return True

    def note_share(self, step: int, rank: int, names: dict[str, int]) -> None:
        """Rank ``rank``'s objects of ``step`` (name -> stored size) are durable here. A local
        tier keeps the list, so that this node uploads them even when the step's manifest is
        written on another node's tier; other backends need nothing."""
        return None


def check_name(name: str) -> str:
    """``name`` if it is a valid object name; BadInputError for empty, absolute, ``..``, ``.tmp`` names."""
    from .. import knobs

    parts = name.split("/")
    if not name or name.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise BadInputError(f"invalid object name {name!r}")
    if name.endswith(knobs.tmp_suffix()):
        raise BadInputError(f"object names may not end in {knobs.tmp_suffix()}: {name!r}")
    return name


def open_objects(
    uri: str,
    *,
    create: bool = True,
    endpoint_url: str | None = None,
    check: bool = True,
    s3_timeout: float | None = None,
) -> ObjectStore:
    """The backend for ``uri``: a local path, a ``file://`` URI or ``s3://bucket/prefix``.

    ``endpoint_url`` (S3 only) names an S3-compatible server; by default boto3 takes it from
    ``AWS_ENDPOINT_URL`` or talks to AWS. ``check`` False (S3 only) skips asking the server
    whether the bucket and store exist (a local tier opening while it cannot be reached).
    ``s3_timeout``: seconds to connect and per read (default ``CKPTSTORE_S3_TIMEOUT``).
    """
    parsed = urlparse(uri)
    if parsed.scheme == "s3":
        # boto3 is imported only by stores that need it.
        from .s3 import S3ObjectStore

        return S3ObjectStore(uri, create=create, endpoint_url=endpoint_url, check=check, timeout=s3_timeout)
    if endpoint_url is not None:
        raise BadInputError(f"endpoint_url applies to s3:// stores, not to {uri!r}")
    if parsed.scheme in ("", "file") or (len(parsed.scheme) == 1 and uri[1:3] in (":\\", ":/")):
        from .local import LocalObjectStore

        path = parsed.path if parsed.scheme == "file" else uri
        if parsed.scheme == "file" and parsed.netloc:
            raise BadInputError(f"file URIs name a local path (file:///abs/path), not a host: {uri}")
        if not path:  # "file://" would otherwise name the working directory
            raise BadInputError(f"{uri!r} names no path (file:///abs/path)")
        return LocalObjectStore(path, create=create)
    raise BadInputError(
        f"unsupported store URI scheme {parsed.scheme!r} in {uri!r} (use a path, file:// or s3://)"
    )
