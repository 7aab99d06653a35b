"""The store config object, and the one version rule every stored format follows.

The rule: whatever carries a format version (the store config, a manifest, a blob header) is
read when its version is one this code knows, refused with UnsupportedError (exit 6) naming
what and which version when a newer ckptstore wrote it, and reported as CorruptError when the
version is not a version at all. The catalog's schema follows the same rule by its migrations.
"""

from __future__ import annotations

import json
from typing import Any

from ..errors import BadInputError, CorruptError, NotFoundError, UnsupportedError
from ..objects import ObjectStore
from .layout import BLOBS, CONFIG, FILES, MANIFESTS, PACKS

# ``tier/``: a local tier's own records (``ckptstore.tier``).
NAMESPACES = (BLOBS, PACKS, FILES, MANIFESTS, "tier/")

# 1: a blob per stored tensor. 2: a pack per rank and layer (``format.pack``), CKPM manifests.
STORE_FORMAT_VERSION = 2


def check_version(what: str, version: Any, supported: int) -> int:
    """``version`` if this code reads it; UnsupportedError if newer than ``supported``,
    CorruptError if it is not a positive integer. ``what`` names the object in the message."""
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise CorruptError(f"{what} has no valid format version ({version!r})")
    if version > supported:
        raise UnsupportedError(
            f"{what} has format version {version}, written by a newer ckptstore; this ckptstore "
            f"reads up to version {supported} (upgrade ckptstore)"
        )
    return version


def ensure_config(objects: ObjectStore, *, create: bool = True) -> dict:
    """The store's config, written first if the store has none; refuses a newer format.

    Without a config, ``objects`` is a store only if it holds nothing but what a store holds
    (a store whose config was lost: the config is written again); else, when empty, it becomes
    one only with ``create`` (NotFoundError otherwise), and holding anything else it is no store
    (BadInputError naming it): ``log`` or ``gc`` pointed at the wrong folder must not claim it.
    """
    try:
        data = objects.get(CONFIG)
    except NotFoundError:
        if not _holds_a_store(objects):
            if not create:
                raise NotFoundError(f"no store at {objects.uri} (it has no {CONFIG})") from None
        config = {"format_version": STORE_FORMAT_VERSION, "hash": "xxh3-128", "codec": "ckpb1+zstd"}
        if not objects.put_if_absent(CONFIG, json.dumps(config, sort_keys=True).encode()):
            return ensure_config(objects)  # another process created the store meanwhile
        return config
    try:
        config = json.loads(data)
    except (ValueError, RecursionError):
        raise CorruptError(f"{objects.uri}/{CONFIG} is not valid JSON") from None
    if not isinstance(config, dict):
        raise CorruptError(f"{objects.uri}/{CONFIG} is not a JSON object")
    check_version(f"the store {objects.uri}", config.get("format_version"), STORE_FORMAT_VERSION)
    return config


# What a store holds besides its config: the layout's namespaces, and a local store's catalog and lock.
_STORE_FILES = {CONFIG, "catalog.db", "catalog.db-wal", "catalog.db-shm", "catalog.db-journal", "lock"}


def _holds_a_store(objects: ObjectStore) -> bool:
    """Whether ``objects`` holds store objects (True) or nothing (False); BadInputError naming
    the first name a store never holds. In-flight ``.tmp`` writes are never listed."""
    found = False
    for info in objects.list():
        if info.name not in _STORE_FILES and not info.name.startswith(NAMESPACES):
            raise BadInputError(
                f"{objects.uri} is not a ckptstore store: it has no {CONFIG} and holds {info.name}"
            )
        found = True
    return found


def upgrade(objects: ObjectStore) -> None:
    """Mark a store of an older format as written in the current one, before a commit adds
    objects of the current format, so that an older ckptstore refuses the store as a whole
    rather than misreading the new step. Steps of the older format stay readable."""
    config = ensure_config(objects)
    if config.get("format_version", STORE_FORMAT_VERSION) >= STORE_FORMAT_VERSION:
        return
    # Not atomic, and needs not be: a store without a config gets the current one when opened.
    objects.delete(CONFIG)
    objects.put_if_absent(
        CONFIG, json.dumps({**config, "format_version": STORE_FORMAT_VERSION}, sort_keys=True).encode()
    )
