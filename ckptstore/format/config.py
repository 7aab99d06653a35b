"""The store config object, and the one version rule every stored format follows.

The rule: whatever carries a format version (the store config, a manifest, a blob header) is
read when its version is one this code knows, refused with UnsupportedError (exit 6) naming
what and which version when a newer ckptstore wrote it, and reported as CorruptError when the
version is not a version at all. The catalog's schema follows the same rule by its migrations.
"""

from __future__ import annotations

import json
import time
from typing import Any

from ..errors import BadInputError, CorruptError, NotFoundError, UnsupportedError
from ..hashing import ContentHash
from ..keys import HOW_TO_PASS
from ..objects import ObjectStore
from .layout import BLOBS, CONFIG, FILES, MANIFESTS, PACKS, TIER_REMOTE

# ``tier/``: a local tier's own records (``ckptstore.tier``); ``quarantine/``: objects
# ``verify --quarantine`` moved aside.
NAMESPACES = (BLOBS, PACKS, FILES, MANIFESTS, "tier/", "quarantine/")

# 1: a blob per stored tensor. 2: a pack per rank and layer (``format.pack``), CKPM manifests.
STORE_FORMAT_VERSION = 2
# 3: format 2 in a store with a key: keyed content keys, tagged manifests (``ckptstore.hashing``).
# Only a store created with a key has it, so that an older ckptstore refuses the store whole
# rather than reading what it cannot check.
AUTHENTICATED_FORMAT_VERSION = 3


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
    """The store's config; refuses a newer format, and a store whose key
    ``objects.content_hash`` does not match (``check_key``).

    Only an empty location gets a config written, and only with ``create`` (the store is
    created then: authenticated, format 3 recording the key's check value and never the key,
    when ``objects`` carries a key); empty without ``create`` it is NotFoundError. A location
    that holds store objects but no config is a store that lost it: CorruptError naming the fix,
    and nothing is written, since a config written anew would describe a store ckptstore cannot
    know (a keyed store's config recorded the key's check value: an unkeyed one written over
    it would lock the key out, and let whoever writes the store in). Holding anything else it
    is no store (BadInputError naming it): ``log`` or ``gc`` pointed at the wrong folder must
    not claim it.
    """
    try:
        data = objects.get(CONFIG)
    except NotFoundError:
        if _holds_a_store(objects):
            return _config_lost(objects)
        if not create:
            raise NotFoundError(f"no store at {objects.uri} (it has no {CONFIG})") from None
        config = new_config(objects.content_hash)
        if not objects.put_if_absent(CONFIG, json.dumps(config, sort_keys=True).encode()):
            return ensure_config(objects)  # another process created the store meanwhile
        return config
    try:
        config = json.loads(data)
    except (ValueError, RecursionError):
        raise CorruptError(f"{objects.uri}/{CONFIG} is not valid JSON") from None
    if not isinstance(config, dict):
        raise CorruptError(f"{objects.uri}/{CONFIG} is not a JSON object")
    check_version(f"the store {objects.uri}", config.get("format_version"), AUTHENTICATED_FORMAT_VERSION)
    check_key(objects.uri, config, objects.content_hash)
    return config


def _config_lost(objects: ObjectStore) -> dict:
    """The config of the store ``objects`` that was found without one: there after all (an
    ``upgrade`` replaces it by a delete and a create; a moment later it is back), else
    CorruptError naming the fix."""
    time.sleep(0.2)
    if objects.exists(CONFIG):
        return ensure_config(objects, create=False)
    raise CorruptError(
        f"the store {objects.uri} holds objects but no {CONFIG} (deleted?); nothing was changed: "
        f"put its {CONFIG} back (from a backup or another copy of the store). ckptstore does not "
        "write a new one over a store's objects, which could lock a store created with a key out"
    )


def new_config(content_hash: ContentHash) -> dict:
    """The config of a new store whose content is named by ``content_hash``."""
    config = {"format_version": STORE_FORMAT_VERSION, "hash": content_hash.name, "codec": "ckpb1+zstd"}
    if content_hash.authenticated:
        config.update(format_version=AUTHENTICATED_FORMAT_VERSION, key_check=content_hash.key_check)
    return config


def check_key(uri: str, config: dict, content_hash: ContentHash) -> None:
    """Refuse to open the store at ``uri`` (config ``config``) with ``content_hash``: a store
    created with a key opens only with that key, one created without only without (BadInputError
    saying how); CorruptError for a config that claims a key inconsistently."""
    authenticated = config.get("format_version") == AUTHENTICATED_FORMAT_VERSION
    if authenticated != (config.get("hash") == "blake3-keyed-128") or (
        authenticated and not isinstance(config.get("key_check"), str)
    ):
        raise CorruptError(f"the store {uri} has a config that is neither with a key nor without one")
    if authenticated and not content_hash.authenticated:
        raise BadInputError(f"the store {uri} was created with a key and opens only with it: {HOW_TO_PASS}")
    if not authenticated and content_hash.authenticated:
        raise BadInputError(
            f"the store {uri} was created without a key; open it without one (a key cannot be "
            "added to an existing store: commit into a new store opened with the key)"
        )
    if authenticated and config["key_check"] != content_hash.key_check:
        raise BadInputError(f"the key given is not the key of the store {uri} (it was created with another)")


# What a store holds besides its config: the layout's namespaces, and a local store's catalog and lock.
_STORE_FILES = {CONFIG, "catalog.db", "catalog.db-wal", "catalog.db-shm", "catalog.db-journal", "lock"}


def _holds_a_store(objects: ObjectStore) -> bool:
    """Whether ``objects`` holds store objects (True) or nothing (False); BadInputError naming
    the first name a store never holds. In-flight ``.tmp`` writes are never listed, and neither
    counts a local tier's pairing record, which it writes before its config."""
    found = False
    for info in objects.list():
        if info.name == TIER_REMOTE:
            continue
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
    # Not atomic (an object store has no replace that is): an open in between finds no config
    # and looks again a moment later (``_config_lost``). A process killed in between leaves
    # the store reported as missing its config; its contents are then those written here.
    objects.delete(CONFIG)
    objects.put_if_absent(
        CONFIG, json.dumps({**config, "format_version": STORE_FORMAT_VERSION}, sort_keys=True).encode()
    )
