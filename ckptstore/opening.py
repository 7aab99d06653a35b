"""Opening a store from a URI: the object store it names, its format check, and its catalog.

The catalog indexes the store's manifests (``catalog.sync``): a local store keeps it in
``catalog.db`` beside the objects, an S3 store on each machine under ``CKPTSTORE_CACHE``, and a
store with a local tier (``local=``) in the tier's directory.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from . import knobs, private, remote_knobs
from .arguments import check_path
from .catalog import file as catalog_file
from .catalog import sync
from .errors import BadInputError, CkptStoreError, NotFoundError, StorageError, clip
from .format.config import ensure_config
from .format.layout import CONFIG
from .hashing import ContentHash
from .keys import content_hash_for
from .objects import ObjectStore, open_objects
from .objects.local import LocalObjectStore
from .objects.tiered import TieredObjectStore
from .store import Store
from .tier import Tier
from .tier.pairing import REMOTE, pair, paired_remote

log = logging.getLogger("ckptstore")


def open(  # noqa: A001 - the public name
    uri: str | os.PathLike,
    *,
    create: bool = True,
    endpoint_url: str | None = None,
    local: str | os.PathLike | None = None,
    local_keep: int | None = None,
    local_max_bytes: int | None = None,
    local_upload: str | None = None,
    replicas: int | None = None,
    s3_timeout: float | None = None,
    key: bytes | None = None,
) -> Store:
    """Open (and by default create) the store at ``uri``: a path, ``file://`` or ``s3://bucket/prefix``.

    ``key`` (bytes, at least 32; default: the file ``CKPTSTORE_KEY_FILE`` names) makes the store
    authenticated (``ckptstore.hashing``): created with a key, a store opens only with that key,
    and every read checks that what it uses was written by a holder of the key; nothing a
    store writer without the key puts in the store is restored, listed as a step or obeyed by
    gc. A store created without a key opens only without one.

    The catalog is brought up to date from the store's manifests here (an S3 store's lives
    under ``CKPTSTORE_CACHE``; steps committed elsewhere later appear on the next open); a
    missing or empty one loses nothing, and one SQLite cannot read is rebuilt.
    ``endpoint_url`` names an S3-compatible server (default: ``AWS_ENDPOINT_URL``, else AWS).
    ``s3_timeout``: seconds an S3 request waits to connect and for each read of a reply
    (default ``CKPTSTORE_S3_TIMEOUT``, 8; retried ``CKPTSTORE_S3_MAX_ATTEMPTS`` times in all).

    ``local`` (default ``CKPTSTORE_LOCAL``; "" for none) puts a local tier in front of the
    store: a node-local directory that commits write to and reads take from first, uploaded to
    the store behind training (``local_upload="background"``, the default, or
    ``CKPTSTORE_LOCAL_UPLOAD``: a thread that starts at once on steps a killed process left)
    or only by ``Store.drain`` (``"drain"``); see ``ckptstore.tier``. Once uploaded, the tier
    keeps only what its ``local_keep`` newest steps need (default ``CKPTSTORE_LOCAL_KEEP``, 2).
    Past ``local_max_bytes`` of steps not uploaded yet (default ``CKPTSTORE_LOCAL_MAX_BYTES``,
    0: no limit) a commit waits for the uploads. A directory fronts one store: it records
    which, and refuses another. ``replicas`` (default ``CKPTSTORE_REPLICAS``, 0) copies each
    commit into the local tiers of that many other nodes of the job, behind training
    (``ckptstore.tier.replicas``); with it, opening is collective (every rank opens).

    Raises BadInputError for a ``uri`` that is no path or URI string, or a key the store was not
    created with (or one it was created with, missing), NotFoundError if the
    store (or its bucket) does not exist and ``create`` is false,
    UnsupportedError if it was written by a newer ckptstore format, StorageError if the
    storage cannot be reached or refuses access, BadInputError for a ``local`` directory that
    is the store itself, fronts another store or is a store of its own. A local tier that has
    fronted the store before opens even while the store cannot be reached: its steps and those
    of the store it knew are listed, commits land in the tier, and uploads wait for the store.
    Every ``CKPTSTORE_*`` setting is checked first (``knobs.check_all``: BadInputError naming a
    bad one). A location that holds store objects but no ``config.json`` is CorruptError, even
    with ``create``: only an empty one becomes a store.
    """
    knobs.check_all()
    if not isinstance(create, bool):
        raise BadInputError(f"create must be True or False, not {clip(repr(create), 40)}")
    # Each argument with a CKPTSTORE_* form is held to that setting's range by its reader.
    local = knobs.local_tier(None if local is None else check_path(local, "local"))
    local_keep, local_max_bytes = (
        remote_knobs.local_keep(local_keep),
        remote_knobs.local_max_bytes(local_max_bytes),
    )
    upload, replicas = remote_knobs.local_upload(local_upload), remote_knobs.replicas(replicas)
    s3_timeout = remote_knobs.s3_timeout(s3_timeout)
    content_hash = content_hash_for(key)
    if local and not create:
        _require_tier(local)  # a read never makes a tier (a mistyped --local would)
    offline = False
    try:
        objects = _open_objects(
            uri, create=create, endpoint_url=endpoint_url, s3_timeout=s3_timeout, content_hash=content_hash
        )
    except StorageError as exc:
        objects = _unreachable_remote(
            uri, local, endpoint_url, exc, s3_timeout, fresh=bool(replicas), committing=create
        )
        objects.content_hash = content_hash
        offline = True
    if not local:
        if replicas:
            raise BadInputError("replicas= copies commits between nodes' local tiers: open with local= too")
        return Store(objects, catalog_file.open_catalog(objects))
    tiered, tier = _open_tier(
        objects, local, endpoint_url, offline=offline, keep=local_keep, max_bytes=local_max_bytes,
        replicas=replicas,
    )  # fmt: skip
    store = Store(tiered, catalog_file.open_catalog(tiered), tier=tier)
    if upload == "background":
        tier.upload_behind()
    return store


def open_local_tier(path: str | os.PathLike, *, key: bytes | None = None) -> Store:
    """Open the store the local tier at ``path`` fronts, through that tier, uploading only when
    drained (``ckptstore drain --local PATH`` after a crash); ``key`` as ``open`` takes it.
    NotFoundError if ``path`` is no local tier."""
    directory = LocalObjectStore(path, create=False)
    remote, endpoint = paired_remote(directory)
    return open(
        remote, create=False, endpoint_url=endpoint, local=directory.root, local_upload="drain", key=key
    )


def rebuild_catalog(
    uri: str | os.PathLike, *, endpoint_url: str | None = None, key: bytes | None = None
) -> sync.SyncReport:
    """Replace the store's catalog by one rebuilt from its manifests; returns what it holds.

    For an S3 store that is the local index; for a local store its ``catalog.db`` (which may
    be missing or corrupt). Every step whose manifest is readable and whose packs are all
    present comes back; the report names the steps that do not (unreadable manifests,
    missing packs, and steps the previous catalog held whose manifest is gone, in which case
    the previous catalog is kept aside). Run it while nothing else uses the store's catalog.
    Raises NotFoundError if there is no store at ``uri``, UnsupportedError if a newer
    ckptstore wrote the store or one of its manifests.
    """
    knobs.check_all()
    objects = _open_objects(uri, create=False, endpoint_url=endpoint_url, content_hash=content_hash_for(key))
    return catalog_file.rebuild(sync.catalog_path(objects), objects)


def _open_objects(
    uri: str | os.PathLike,
    *,
    create: bool,
    endpoint_url: str | None,
    content_hash: ContentHash,
    s3_timeout: float | None = None,
) -> ObjectStore:
    if not isinstance(uri, str | os.PathLike):
        raise BadInputError(
            f"the store must be a path or a URI (a string or os.PathLike), not {type(uri).__name__}"
        )
    uri = os.fspath(uri)
    if not isinstance(uri, str):
        raise BadInputError(f"the store must be a path or a URI string, not {type(uri).__name__}")
    if not uri:
        raise BadInputError("no store given (pass a path or URI, or set CKPTSTORE_STORE)")
    objects = open_objects(uri, create=create, endpoint_url=endpoint_url, s3_timeout=s3_timeout)
    objects.content_hash = content_hash
    if getattr(objects, "root", None) is not None and objects.exists(REMOTE):
        remote, _ = paired_remote(objects)
        raise BadInputError(
            f"{objects.uri} is the local tier of {remote}: open {remote} with local={objects.uri}"
        )
    ensure_config(objects, create=create)
    return objects


def _unreachable_remote(
    uri: str | os.PathLike,
    local: str,
    endpoint_url: str | None,
    error: StorageError,
    s3_timeout: float | None,
    *,
    fresh: bool = False,
    committing: bool = True,
) -> ObjectStore:
    """The store at ``uri``, unchecked, when it cannot be reached but the local tier ``local``
    has fronted it before (training goes on into the tier), or is new and ``fresh`` allows it
    (a replaced node of a job with replicas: its peers' tiers hold what it restores); else
    ``error`` is raised. ``committing``: the store was opened to commit (``create``), not
    only to read, which the warning says."""
    if not (local and error.transient):
        raise error
    remote = open_objects(os.fspath(uri), endpoint_url=endpoint_url, check=False, s3_timeout=s3_timeout)
    try:
        fronted, _ = paired_remote(LocalObjectStore(local, create=False))
    except CkptStoreError:
        if not (fresh and _is_empty(local)):
            raise error from None
        fronted = remote.uri
    if fronted != remote.uri:
        raise error
    doing = "committing to" if committing else "reading what is in"
    log.warning("ckptstore: %s cannot be reached (%s); %s the local tier %s", remote.uri, error, doing, local)
    return remote


def _require_tier(path: str) -> None:
    """NotFoundError naming ``path`` unless it is a local tier already (``tier.pairing``): a
    store opened without ``create`` only reads, and reading makes no tier."""
    try:
        paired_remote(LocalObjectStore(path, create=False))
    except NotFoundError:
        raise NotFoundError(
            f"no local tier at {path} (only a store opened to commit, open(create=True), makes one)"
        ) from None


def _is_empty(path: str) -> bool:
    """Whether ``path`` is no directory yet, or an empty one."""
    folder = Path(path).expanduser()
    return not folder.exists() or (folder.is_dir() and not any(folder.iterdir()))


def _open_tier(
    remote: ObjectStore,
    path: str,
    endpoint_url: str | None,
    *,
    keep: int,
    max_bytes: int,
    replicas: int = 0,
    offline: bool = False,
) -> tuple[TieredObjectStore, Tier]:
    """The local tier at ``path`` in front of ``remote``, paired with it (``keep`` and
    ``max_bytes`` checked by ``open``)."""
    if remote.content_hash.authenticated:  # the tier's objects, pairing and catalog are trusted
        private.make_folder(Path(path).expanduser().absolute())
        private.require_private(path, "the local tier")
    local = LocalObjectStore(path, create=True)
    local.content_hash = remote.content_hash
    if getattr(remote, "root", None) == local.root:
        raise BadInputError(f"local={path} is the store itself: give the local tier a directory of its own")
    if local.exists(CONFIG) and not local.exists(REMOTE):
        raise BadInputError(
            f"local={path} is a store of its own, not a local tier: give the tier an empty directory"
        )
    pair(local, remote.uri, endpoint_url)
    ensure_config(local, create=True)
    tier = Tier(local, remote, keep=keep, max_bytes=max_bytes, remote_checked=not offline, replicas=replicas)
    tiered = TieredObjectStore(local, remote, offline=offline)
    tiered.content_hash = remote.content_hash
    return tiered, tier
