"""Opening a store from a URI: the object store it names, its format check, and its catalog.

The catalog indexes the store's manifests (``catalog.sync``): a local store keeps it in
``catalog.db`` beside the objects, an S3 store on each machine under ``CKPTSTORE_CACHE``.
"""

from __future__ import annotations

import os

from .catalog import sync
from .errors import BadInputError
from .format.config import ensure_config
from .objects import ObjectStore, open_objects
from .store import Store


def open(  # noqa: A001 - the public name
    uri: str | os.PathLike, *, create: bool = True, endpoint_url: str | None = None
) -> Store:
    """Open (and by default create) the store at ``uri``: a path, ``file://`` or ``s3://bucket/prefix``.

    The catalog is brought up to date from the store's manifests here (an S3 store's lives
    under ``CKPTSTORE_CACHE``; steps committed elsewhere later appear on the next open); a
    missing or empty one loses nothing, and one SQLite cannot read is rebuilt.
    ``endpoint_url`` names an S3-compatible server (default: ``AWS_ENDPOINT_URL``, else AWS).
    Raises NotFoundError if the store (or its bucket) does not exist and ``create`` is false,
    UnsupportedError if it was written by a newer ckptstore format, StorageError if the
    storage cannot be reached or refuses access.
    """
    objects = _open_objects(uri, create=create, endpoint_url=endpoint_url)
    return Store(objects, sync.open_catalog(objects))


def rebuild_catalog(uri: str | os.PathLike, *, endpoint_url: str | None = None) -> sync.SyncReport:
    """Replace the store's catalog by one rebuilt from its manifests; returns what it holds.

    For an S3 store that is the local index; for a local store its ``catalog.db`` (which may
    be missing or corrupt). Every step whose manifest is readable and whose packs are all
    present comes back; the report names the steps that do not (unreadable manifests,
    missing packs, and steps the previous catalog held whose manifest is gone, in which case
    the previous catalog is kept aside). Run it while nothing else uses the store's catalog.
    Raises NotFoundError if there is no store at ``uri``, UnsupportedError if a newer
    ckptstore wrote the store or one of its manifests.
    """
    objects = _open_objects(uri, create=False, endpoint_url=endpoint_url)
    return sync.rebuild(sync.catalog_path(objects), objects)


def _open_objects(uri: str | os.PathLike, *, create: bool, endpoint_url: str | None) -> ObjectStore:
    uri = os.fspath(uri)
    if not uri:
        raise BadInputError("no store given (pass a path or URI, or set CKPTSTORE_STORE)")
    objects = open_objects(uri, create=create, endpoint_url=endpoint_url)
    ensure_config(objects, create=create)
    return objects
