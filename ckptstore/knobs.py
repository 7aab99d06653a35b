"""Internal constants, each overridable by a ``CKPTSTORE_*`` environment variable.

Tests use the overrides to force edge cases (tiny thresholds, one thread) in small runs.
"""

from __future__ import annotations

import math
import os


def _int(name: str, default: int, minimum: int | None = None) -> int:
    """``CKPTSTORE_<name>`` as an integer of at least ``minimum`` (``default`` when unset);
    BadInputError naming it when it is not one."""
    value = os.environ.get(f"CKPTSTORE_{name}")
    if value is None:
        return default
    try:
        number = int(value)
    except ValueError:
        number = None
    if number is None or (minimum is not None and number < minimum):
        raise _bad(name, value, "an integer" if minimum is None else f"an integer >= {minimum}")
    return number


def _float(name: str, default: float) -> float:
    """``CKPTSTORE_<name>`` as a finite non-negative number (``default`` when unset);
    BadInputError naming it when it is not one."""
    value = os.environ.get(f"CKPTSTORE_{name}")
    if value is None:
        return default
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not math.isfinite(number) or number < 0:
        raise _bad(name, value, "a finite non-negative number")
    return number


def _bad(name: str, value: str, kind: str) -> Exception:
    from .errors import BadInputError, clip

    return BadInputError(f"CKPTSTORE_{name} must be {kind}, not {clip(repr(value), 40)}")


def zstd_level() -> int:
    """zstd compression level for blob payloads (1 is fast and keeps most of the gain)."""
    return _int("ZSTD_LEVEL", 1)


def min_compress_ratio() -> float:
    """Store a payload raw unless zstd shrinks it below this fraction of its size."""
    return _float("MIN_COMPRESS_RATIO", 0.97)


def background_nice() -> int:
    """Nice increment of the threads that hash, compress and write a non-blocking commit."""
    return _int("BACKGROUND_NICE", 10)


def cpu_threads() -> int:
    """Threads that hash, compress or decode at once: by default one per core this process may
    use. A commit's ranks on one machine compress at the same time and split these."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 2
    return _int("CPU_THREADS", cores, 1)


def ranks_on_this_machine() -> int:
    """Ranks of this job on this machine (torchrun's LOCAL_WORLD_SIZE; 1 outside torchrun)."""
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or 1))


def io_threads() -> int:
    """Blobs stored or fetched at once. More than ``cpu_threads``, so that while some threads
    wait on a disk (fsync) or the network, others keep every core compressing or decoding."""
    return _int("IO_THREADS", max(8, cpu_threads()), 1)


def tmp_suffix() -> str:
    """Suffix of in-flight local writes; listings never show these names."""
    return ".tmp"


def gc_grace_seconds() -> float:
    """Unreferenced blobs younger than this are never swept (a commit may be writing them).
    BadInputError unless ``CKPTSTORE_GC_GRACE`` is a finite non-negative number of seconds."""
    from .errors import BadInputError

    value = os.environ.get("CKPTSTORE_GC_GRACE")
    try:
        seconds = 3600.0 if value is None else float(value)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds < 0:  # nan would switch the grace period off
        raise BadInputError(
            f"CKPTSTORE_GC_GRACE must be a finite non-negative number of seconds, not {value!r}"
        )
    return seconds


def cache_dir() -> str:
    """Where stores without a local directory (S3) keep their catalog index, one folder per store."""
    return os.environ.get("CKPTSTORE_CACHE") or os.path.join("~", ".cache", "ckptstore")


def s3_multipart_threshold() -> int:
    """S3 objects of at least this many bytes are uploaded in parts (and downloaded by ranges)."""
    return _int("S3_MULTIPART_THRESHOLD", 64 * 1024 * 1024, 1)


def s3_part_size() -> int:
    """Size of one multipart part or download range (boto3 raises it to S3's 5 MiB minimum)."""
    return _int("S3_PART_SIZE", 16 * 1024 * 1024, 1)


def s3_part_threads() -> int:
    """Parts of one large S3 object transferred at once (on top of the io_threads objects)."""
    return _int("S3_PART_THREADS", 4, 1)


def s3_max_attempts() -> int:
    """Attempts per S3 request in botocore's standard retry mode (first try included)."""
    return _int("S3_MAX_ATTEMPTS", 5, 1)


def s3_timeout() -> float:
    """Seconds an S3 request may wait to connect, and then for each read of the reply, before
    it fails (and is retried, ``s3_max_attempts`` in all). With the defaults a command against
    an endpoint that accepts connections and never answers fails within a minute: 5 attempts
    of 8 s plus botocore's backoff between them (at most 1 + 2 + 4 + 8 s)."""
    seconds = _float("S3_TIMEOUT", 8.0)
    if seconds <= 0:
        raise _bad("S3_TIMEOUT", str(seconds), "a positive number of seconds")
    return seconds


def s3_freshen_after() -> float:
    """An S3 object reused by a commit is re-timed only when older than this (seconds).

    Freshening an S3 object copies it onto itself; skipping young ones keeps re-commits cheap.
    gc's grace period must be longer than this plus the longest commit.
    """
    return _float("S3_FRESHEN_AFTER", 300.0)


def sample_size() -> int:
    """Elements of each parameter sampled per commit for update statistics (ckptstore.stats)."""
    return _int("SAMPLE_SIZE", 256, 0)


def map_bytes() -> int:
    """A local object's byte range at least this long is mapped rather than read (0: none
    is): the decoder then reads the page cache in place instead of a copy in fresh memory."""
    return _int("MAP_BYTES", 1 << 20, 0)


def max_file_bytes() -> int:
    """Largest auxiliary file a commit stores with a step (``commit(files=...)``)."""
    return _int("MAX_FILE_BYTES", 256 * 1024 * 1024, 0)


def pack_bytes() -> int:
    """Tensor bytes past which a rank's pack of one layer is cut into several (format 2): bounds
    one object (and the spill file a commit encodes it into), and lets a big layer compress on
    several cores."""
    return _int("PACK_BYTES", 32 * 1024 * 1024, 1)


def manifest_max_expansion() -> int:
    """A manifest may decompress to at most this many times its stored size (or
    ``manifest_min_bound``): its JSON compresses about ten times, a zstd bomb thousands."""
    return _int("MANIFEST_MAX_EXPANSION", 64, 1)


def manifest_min_bound() -> int:
    """Bytes any manifest may decompress to, however small it is stored."""
    return _int("MANIFEST_MIN_BOUND", 4 * 1024 * 1024, 1)


def local_tier() -> str:
    """The local tier's directory for stores opened without ``local=`` ("" or unset: none)."""
    return os.environ.get("CKPTSTORE_LOCAL", "")


def local_keep() -> int:
    """Steps whose objects a local tier keeps once they are uploaded (``local_keep=``)."""
    return _int("LOCAL_KEEP", 2, 0)


def local_upload() -> str:
    """How a local tier uploads: "background" (a thread, as steps land) or "drain" (only when
    ``drain`` is called, or from ``ckptstore drain``). BadInputError for anything else."""
    from .errors import BadInputError

    value = os.environ.get("CKPTSTORE_LOCAL_UPLOAD", "background")
    if value not in ("background", "drain"):
        raise BadInputError(f"CKPTSTORE_LOCAL_UPLOAD must be background or drain, not {value!r}")
    return value


def local_max_bytes() -> int:
    """Bytes of steps not uploaded yet past which a commit waits for the uploads (0: no limit)."""
    return _int("LOCAL_MAX_BYTES", 0, 0)


def local_retry_first() -> float:
    """Seconds before a failed background upload is first retried (doubling each time)."""
    return _float("LOCAL_RETRY_FIRST", 1.0)


def local_retry_longest() -> float:
    """The longest wait between retries of a failing background upload, in seconds."""
    return _float("LOCAL_RETRY_LONGEST", 60.0)


def local_poll_seconds() -> float:
    """How often the background uploader looks for steps a commit it was not told of left."""
    return _float("LOCAL_POLL_SECONDS", 2.0)


def local_wait_ranks() -> float:
    """Seconds a drain without a timeout waits for other ranks' uploads of a step."""
    return _float("LOCAL_WAIT_RANKS", 600.0)


def readahead_bytes() -> int:
    """Bytes of pack entries a reader that reads whole steps may fetch ahead of being asked
    for them (coalesced into few requests a pack); past it, entries are read one by one."""
    return _int("READAHEAD_BYTES", 128 * 1024 * 1024, 0)


def export_threads() -> int:
    """Most threads an export from a local store decodes with (at most one per core and one
    more). Its decoding holds the GIL between numpy calls, so past a few threads they mostly
    wait for it: on a 16-core machine a 267M model's bf16 export took 0.86 s on one thread,
    0.40-0.43 s on 4 and 0.62-0.65 s on 16."""
    return _int("EXPORT_THREADS", 4, 1)


def export_buffer_bytes() -> int:
    """Memory export keeps for casting tensors it reads whole (a DCP step's, a format-1 blob's;
    those in packs are decoded a piece at a time), reused from one tensor to the next (a tensor
    that alone needs more gets it, one at a time). 0, the default: a 4 MiB window per ``cpu_threads``."""
    return _int("EXPORT_BUFFER_BYTES", 0, 0)
