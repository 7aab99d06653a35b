"""Every ``CKPTSTORE_*`` environment setting: the internal constants it overrides, its range, and
the check of them all at once.

Each setting is a function here that reads its variable and returns its value (the default
when unset), raising BadInputError naming the variable when the value is out of its range.
Each is registered in ``SETTINGS`` (``settings``); ``check_all`` reads every one and warns about a
``CKPTSTORE_*`` name that is none of them (a misspelt setting would otherwise be silently
unused). The CLI calls it before any command and ``ckptstore.open`` before opening a store, so
a bad value stops the command at once, not deep inside one (or never, when the code that reads
it does not run). A setting that is also an argument of ``ckptstore.open`` (``s3_timeout=``,
``local_keep=``...) takes that argument as ``given``: the argument is held to the same range,
by the same code, and the error names the argument. Tests use the overrides to force edge cases (tiny thresholds, one thread) in
small runs; the settings only tests read are registered too. The settings of S3 transfers and
of the local tier with its peers are ``remote_knobs``'.
"""

from __future__ import annotations

import os
from urllib.parse import urlparse

from . import keys, remote_knobs  # noqa: F401 (remote_knobs registers the S3 and local-tier settings)
from .errors import BadInputError, clip
from .settings import (
    DAY,
    MAX_BYTES,
    PREFIX,
    SETTINGS,
    bad_value,
    read_directory,
    read_flag,
    read_float,
    read_int,
    read_raw,
    setting,
    warn_unknown,
)

# Ranges (with settings.MAX_BYTES and DAY). A maximum keeps a value far past sense (a typo, an
# extra digit) from becoming a thread pool of millions, a C integer overflow deep in zstd or
# SQLite, or a wait of centuries.
MAX_THREADS = 1024
YEAR = 365 * DAY
#: The longest grace period gc takes (CKPTSTORE_GC_GRACE, --grace, grace=).
MAX_GRACE = 10 * YEAR
# zstd's level range (ZSTD_minCLevel() is -(1 << 17); the zstandard module exports only the max).
ZSTD_MIN_LEVEL = -(1 << 17)
ZSTD_MAX_LEVEL = 22


def check_all() -> None:
    """Read every registered setting (BadInputError naming the first bad one), and log one
    warning line for each ``CKPTSTORE_*`` variable that is no setting (``settings.warn_unknown``)."""
    warn_unknown()
    for entry in SETTINGS.values():
        entry.read()


# -- compression ---------------------------------------------------------------------------------


@setting("ZSTD_LEVEL", "integer")
def zstd_level() -> int:
    """zstd compression level for blob payloads (1 is fast and keeps most of the gain):
    zstd's own range, -131072 (fastest) to 22."""
    return read_int("ZSTD_LEVEL", 1, ZSTD_MIN_LEVEL, ZSTD_MAX_LEVEL)


@setting("DELTA_CHAIN", "integer")
def delta_chain() -> int:
    """Objects a read decodes for one piece at most: a commit stores a piece that changed as a
    lossless delta against its previous version (``format.pack``), and whole at least every
    this many versions. 1 stores every piece whole (no deltas); 1 to 32."""
    return read_int("DELTA_CHAIN", 4, 1, 32)


@setting("MIN_COMPRESS_RATIO", "number")
def min_compress_ratio() -> float:
    """Store a payload raw unless zstd shrinks it below this fraction of its size (0: always
    raw; above 1: always compressed). 0 to 1000."""
    return read_float("MIN_COMPRESS_RATIO", 0.97, 1000.0)


# -- threads -------------------------------------------------------------------------------------


@setting("BACKGROUND_NICE", "integer")
def background_nice() -> int:
    """Nice increment of the threads that hash, compress and write a non-blocking commit
    (0 to 19, Linux's range of niceness)."""
    return read_int("BACKGROUND_NICE", 10, 0, 19)


@setting("BACKGROUND_CPUS", "CPU list")
def background_cpus() -> frozenset[int] | None:
    """The CPUs a non-blocking commit hashes, compresses and writes on, as Linux writes CPU
    lists (``6,7`` or ``4-7``), so that training keeps the others (on a GPU node, the cores its
    data loaders and launch threads leave idle); its threads are at most that many. Unset: any
    this process may use. Each must be one of this machine's (``os.cpu_count()``): which of
    them a thread may use depends on the thread (training's may be pinned to others)."""
    value = read_raw("BACKGROUND_CPUS")
    if value is None or not value.strip() or not hasattr(os, "sched_setaffinity"):
        return None
    allowed = set(range(os.cpu_count() or 1))
    cpus: set[int] = set()
    for part in value.split(","):
        first, _, last = part.strip().partition("-")
        try:
            low, high = int(first), int(last or first)
        except ValueError:
            low = high = -1
        if not 0 <= low <= high < 1 << 16:
            raise bad_value("BACKGROUND_CPUS", value, "a CPU list such as 6,7 or 4-7")
        cpus.update(range(low, high + 1))
    if not cpus <= allowed:
        raise bad_value("BACKGROUND_CPUS", value, f"CPUs of this machine ({_cpu_list(allowed)})")
    return frozenset(cpus)


def _cpu_list(cpus: set[int]) -> str:
    """``cpus`` as a Linux CPU list (``0-3,6``)."""
    ranges: list[list[int]] = []
    for cpu in sorted(cpus):
        if ranges and cpu == ranges[-1][1] + 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in ranges)


@setting("CPU_THREADS", "integer")
def cpu_threads() -> int:
    """Threads that hash, compress or decode at once: one per core this process may use, the
    setting a cap (more threads than cores would only wait on each other's cores). A commit's
    ranks on one machine compress at the same time and split these."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 2
    cores = min(cores, MAX_THREADS)
    return min(cores, read_int("CPU_THREADS", cores, 1, MAX_THREADS))


def ranks_on_this_machine() -> int:
    """Ranks of this job on this machine (torchrun's LOCAL_WORLD_SIZE; 1 outside torchrun)."""
    value = os.environ.get("LOCAL_WORLD_SIZE") or "1"
    try:
        return min(max(1, int(value)), MAX_THREADS)
    except ValueError:
        raise BadInputError(f"LOCAL_WORLD_SIZE must be an integer, not {clip(repr(value), 40)}") from None


@setting("IO_THREADS", "integer")
def io_threads() -> int:
    """Blobs stored or fetched at once. More than ``cpu_threads``, so that while some threads
    wait on a disk (fsync) or the network, others keep every core compressing or decoding."""
    return read_int("IO_THREADS", max(8, cpu_threads()), 1, MAX_THREADS)


@setting("EXPORT_THREADS", "integer")
def export_threads() -> int:
    """Most decoders an export from a local store runs: by default on Linux a worker process
    per core this process may use (``cpu_threads``; ``forked.worth_running`` forks fewer where
    forking costs more than it saves), elsewhere a thread per core and one more. Threads of
    one process decode without the GIL for the bulk of the bytes, but their calls are short
    enough (13-30 us) that two keep handing it to each other: on the 2-core bench box two
    threads took 0.65x-0.72x of one's time, two processes 0.56x-0.61x. Once a fixed 4 threads
    (on a 16-core machine a 267M model's bf16 export took 0.86 s on one thread, 0.40-0.43 s on
    4 and 0.62-0.65 s on 16)."""
    return read_int("EXPORT_THREADS", min(cpu_threads() + 1, MAX_THREADS), 1, MAX_THREADS)


def tmp_suffix() -> str:
    """Suffix of in-flight local writes; listings never show these names."""
    return ".tmp"


# -- retention -----------------------------------------------------------------------------------


@setting("GC_GRACE", "number")
def gc_grace_seconds() -> float:
    """Unreferenced blobs younger than this many seconds are never swept (a commit may be
    writing them): 0 to ten years."""
    return read_float("GC_GRACE", 3600.0, MAX_GRACE, limit="ten years")


# -- where things are ----------------------------------------------------------------------------


@setting("STORE", "store")
def store_uri() -> str:
    """The store the CLI uses without ``--store`` ("" when unset): a path, ``file://`` or
    ``s3://bucket/prefix`` URI."""
    value = read_raw("STORE") or ""
    parsed = urlparse(value)
    drive = len(parsed.scheme) == 1 and value[1:3] in (":\\", ":/")
    if (parsed.scheme not in ("", "file", "s3") and not drive) or (
        parsed.scheme == "s3" and not parsed.netloc
    ):
        raise bad_value("STORE", value, "a path, a file:// URI or an s3://bucket/prefix URI", plain=True)
    return value


@setting("CACHE", "directory")
def cache_dir() -> str:
    """Where stores without a local directory (S3) keep their catalog index, one folder per store."""
    return read_directory("CACHE") or os.path.join("~", ".cache", "ckptstore")


@setting("LOCAL", "directory")
def local_tier(given: str | None = None) -> str:
    """The local tier's directory for stores opened without ``local=`` ("" or unset: none)."""
    return read_directory("LOCAL", given)


@setting("KEY_FILE", "key file")
def key_file() -> str:
    """The file holding the key stores are opened with ("" when unset: no key); BadInputError
    naming the setting when the file is no key file ``keys.read_key_file`` accepts."""
    value = read_raw("KEY_FILE") or ""
    if value:
        try:
            keys.read_key_file(value)
        except BadInputError as exc:
            raise BadInputError(f"{PREFIX}KEY_FILE: {exc}") from None
    return value


# -- formats and bounds --------------------------------------------------------------------------


@setting("SAMPLE_SIZE", "integer")
def sample_size() -> int:
    """Elements of each parameter sampled per commit for update statistics (ckptstore.stats)."""
    return read_int("SAMPLE_SIZE", 256, 0, 1 << 20)


@setting("MAP_BYTES", "integer")
def map_bytes() -> int:
    """A local object's byte range at least this long is mapped rather than read (0: none
    is): the decoder then reads the page cache in place instead of a copy in fresh memory."""
    return read_int("MAP_BYTES", 1 << 20, 0, MAX_BYTES)


@setting("MAX_FILE_BYTES", "integer")
def max_file_bytes() -> int:
    """Largest auxiliary file a commit stores with a step (``commit(files=...)``)."""
    return read_int("MAX_FILE_BYTES", 256 * 1024 * 1024, 0, MAX_BYTES)


@setting("PACK_BYTES", "integer")
def pack_bytes() -> int:
    """Tensor bytes past which a rank's pack of one layer is cut into several (format 2): bounds
    one object (and the spill file a commit encodes it into), and lets a big layer compress on
    several cores. At most 5 TiB, S3's largest object."""
    return read_int("PACK_BYTES", 32 * 1024 * 1024, 1, 5 << 40)


@setting("MANIFEST_MAX_EXPANSION", "integer")
def manifest_max_expansion() -> int:
    """A manifest may decompress to at most this many times its stored size (or
    ``manifest_min_bound``): its JSON compresses about ten times, a zstd bomb thousands."""
    return read_int("MANIFEST_MAX_EXPANSION", 64, 1, 1 << 20)


@setting("MANIFEST_MIN_BOUND", "integer")
def manifest_min_bound() -> int:
    """Bytes any manifest may decompress to, however small it is stored (at most 16 GiB)."""
    return read_int("MANIFEST_MIN_BOUND", 4 * 1024 * 1024, 1, 1 << 34)


@setting("READAHEAD_BYTES", "integer")
def readahead_bytes() -> int:
    """Bytes of pack entries a reader that reads whole steps may fetch ahead of being asked
    for them (coalesced into few requests a pack); past it, entries are read one by one."""
    return read_int("READAHEAD_BYTES", 128 * 1024 * 1024, 0, MAX_BYTES)


@setting("EXPORT_BUFFER_BYTES", "integer")
def export_buffer_bytes() -> int:
    """Memory export keeps for casting tensors it reads whole (a DCP step's, a format-1 blob's;
    those in packs are decoded a piece at a time), reused from one tensor to the next (a tensor
    that alone needs more gets it, one at a time). 0, the default: a 4 MiB window per ``cpu_threads``."""
    return read_int("EXPORT_BUFFER_BYTES", 0, 0, MAX_BYTES)


@setting("PATTERN_SECONDS", "number")
def pattern_seconds() -> float:
    """Seconds one regular expression of a step's ``universal_checkpoint_info`` may take to
    match one parameter name (``deepspeed.universal_info.matches``) before the step is refused:
    DeepSpeed's patterns take microseconds, one written to backtrack could take hours; above 0,
    at most a minute."""
    return read_float("PATTERN_SECONDS", 1.0, 60.0, positive=True, limit="a minute")


# -- what the CLI shows --------------------------------------------------------------------------


@setting("PROGRESS", "flag")
def progress() -> bool:
    """Whether progress bars may be shown on a terminal (0 hides them)."""
    return read_flag("PROGRESS", True)


@setting("DEBUG", "flag")
def debug() -> bool:
    """Whether the CLI shows the traceback of an internal error."""
    return read_flag("DEBUG", False)


# -- read by the test suite only -----------------------------------------------------------------


@setting("FUZZ_EXAMPLES", "integer", tests_only=True)
def fuzz_examples() -> int:
    """Examples per property of tests/test_parser_fuzz.py."""
    return read_int("FUZZ_EXAMPLES", 300, 1, 10_000_000)


@setting("TEST_HARD_EXIT", "flag", tests_only=True)
def hard_exit_in_tests() -> bool:
    """Whether pytest leaves through ``os._exit`` (tests/conftest.py)."""
    return read_flag("TEST_HARD_EXIT", False)
