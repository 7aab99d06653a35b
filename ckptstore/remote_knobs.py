"""The ``CKPTSTORE_*`` settings of moving objects off this machine: S3 transfers (parts,
threads, retries, timeouts) and the local tier in front of a store with its peer replicas
(uploads, retries, what it keeps, peers' timeouts). Registered as ``knobs``' are (``settings``),
and checked with them by ``knobs.check_all``; each is a function returning its value, raising
BadInputError naming the variable (or the ``ckptstore.open`` argument given) out of range.
"""

from __future__ import annotations

from .settings import DAY, MAX_BYTES, bad_argument, bad_value, read_float, read_int, read_raw, setting

# -- S3 ------------------------------------------------------------------------------------------


@setting("S3_MULTIPART_THRESHOLD", "integer")
def s3_multipart_threshold() -> int:
    """S3 objects of at least this many bytes are uploaded in parts (and downloaded by ranges):
    1 byte to 5 TiB (S3's largest object)."""
    return read_int("S3_MULTIPART_THRESHOLD", 64 * 1024 * 1024, 1, 5 << 40)


@setting("S3_PART_SIZE", "integer")
def s3_part_size() -> int:
    """Size of one multipart part or download range (boto3 raises it to S3's 5 MiB minimum):
    1 byte to 5 GiB (S3's largest part)."""
    return read_int("S3_PART_SIZE", 16 * 1024 * 1024, 1, 5 << 30)


@setting("S3_PART_THREADS", "integer")
def s3_part_threads() -> int:
    """Parts of one large S3 object transferred at once (on top of the io_threads objects)."""
    return read_int("S3_PART_THREADS", 4, 1, 256)


@setting("S3_MAX_ATTEMPTS", "integer")
def s3_max_attempts() -> int:
    """Attempts per S3 request in botocore's standard retry mode (first try included), 1 to 100."""
    return read_int("S3_MAX_ATTEMPTS", 5, 1, 100)


@setting("S3_TIMEOUT", "number")
def s3_timeout(given: object = None) -> float:
    """Seconds an S3 request may wait to connect, and then for each read of the reply, before
    it fails (and is retried, ``s3_max_attempts`` in all); above 0, at most an hour. With the
    defaults a command against an endpoint that accepts connections and never answers fails
    within a minute: 5 attempts of 8 s plus botocore's backoff between them (at most 1 + 2 +
    4 + 8 s)."""
    return read_float("S3_TIMEOUT", 8.0, 3600.0, positive=True, limit="an hour", given=given)


@setting("S3_FRESHEN_AFTER", "number")
def s3_freshen_after() -> float:
    """An S3 object reused by a commit is re-timed only when older than this (seconds, at most
    30 days).

    Freshening an S3 object copies it onto itself; skipping young ones keeps re-commits cheap.
    gc's grace period must be longer than this plus the longest commit.
    """
    return read_float("S3_FRESHEN_AFTER", 300.0, 30 * DAY, limit="30 days")


# -- the local tier ------------------------------------------------------------------------------


@setting("LOCAL_KEEP", "integer")
def local_keep(given: object = None) -> int:
    """Steps whose objects a local tier keeps once they are uploaded (``local_keep=``)."""
    return read_int("LOCAL_KEEP", 2, 0, 1_000_000, given)


@setting("LOCAL_UPLOAD", "choice")
def local_upload(given: object = None) -> str:
    """How a local tier uploads: "background" (a thread, as steps land) or "drain" (only when
    ``drain`` is called, or from ``ckptstore drain``). BadInputError for anything else."""
    value = (read_raw("LOCAL_UPLOAD") or "background") if given is None else given
    if value not in ("background", "drain"):
        if given is not None:
            raise bad_argument("LOCAL_UPLOAD", given, "background or drain")
        raise bad_value("LOCAL_UPLOAD", value, "background or drain")
    return value


@setting("REPLICAS", "integer")
def replicas(given: object = None) -> int:
    """Other nodes' local tiers each commit is copied into (``replicas=``; 0: none)."""
    return read_int("REPLICAS", 0, 0, 1000, given)


@setting("PEER_TIMEOUT", "number")
def peer_timeout() -> float:
    """Seconds a rank waits for each message of a peer rank while copying replicas or serving
    a restore (``tier.replicas``, ``tier.recover``) before it gives up on that peer; above 0,
    at most a day."""
    return read_float("PEER_TIMEOUT", 300.0, DAY, positive=True, limit="a day")


@setting("NODE", "node name")
def node() -> str:
    """This process's node, for choosing replica peers ("" or unset: torchrun's GROUP_RANK,
    else the host name): up to 255 printable characters, no spaces. BadInputError otherwise."""
    value = read_raw("NODE") or ""
    if len(value) > 255 or not all(c.isprintable() and not c.isspace() for c in value):
        raise bad_value("NODE", value, "up to 255 printable characters without spaces")
    return value


@setting("LOCAL_MAX_BYTES", "integer")
def local_max_bytes(given: object = None) -> int:
    """Bytes of steps not uploaded yet past which a commit waits for the uploads (0: no limit)."""
    return read_int("LOCAL_MAX_BYTES", 0, 0, MAX_BYTES, given)


@setting("LOCAL_RETRY_FIRST", "number")
def local_retry_first() -> float:
    """Seconds before a failed background upload is first retried (doubling each time); above
    0 (0 would retry in a busy loop), at most an hour."""
    return read_float("LOCAL_RETRY_FIRST", 1.0, 3600.0, positive=True, limit="an hour")


@setting("LOCAL_RETRY_LONGEST", "number")
def local_retry_longest() -> float:
    """The longest wait between retries of a failing background upload, in seconds (at most a day)."""
    return read_float("LOCAL_RETRY_LONGEST", 60.0, DAY, positive=True, limit="a day")


@setting("LOCAL_POLL_SECONDS", "number")
def local_poll_seconds() -> float:
    """How often the background uploader looks for steps a commit it was not told of left
    (above 0, at most an hour)."""
    return read_float("LOCAL_POLL_SECONDS", 2.0, 3600.0, positive=True, limit="an hour")


@setting("LOCAL_WAIT_RANKS", "number")
def local_wait_ranks() -> float:
    """Seconds a drain without a timeout waits for other ranks' uploads of a step (at most a week)."""
    return read_float("LOCAL_WAIT_RANKS", 600.0, 7 * DAY, limit="a week")
