"""The store config object, and the one version rule every stored format follows.

The rule: whatever carries a format version (the store config, a manifest, a blob header) is
read when its version is one this code knows, refused with UnsupportedError (exit 6) naming
what and which version when a newer ckptstore wrote it, and reported as CorruptError when the
version is not a version at all. The catalog's schema follows the same rule by its migrations.
"""

from __future__ import annotations

import json
from typing import Any

from ..errors import CorruptError, NotFoundError, UnsupportedError
from ..objects import ObjectStore
from .layout import CONFIG

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


def ensure_config(objects: ObjectStore) -> dict:
    """The store's config, written first if the store has none; refuses a newer format."""
    try:
        data = objects.get(CONFIG)
    except NotFoundError:
        config = {"format_version": STORE_FORMAT_VERSION, "hash": "xxh3-128", "codec": "ckpb1+zstd"}
        objects.put_if_absent(CONFIG, json.dumps(config, sort_keys=True).encode())
        return config
    try:
        config = json.loads(data)
    except ValueError:
        raise CorruptError(f"{objects.uri}/{CONFIG} is not valid JSON") from None
    if not isinstance(config, dict):
        raise CorruptError(f"{objects.uri}/{CONFIG} is not a JSON object")
    check_version(f"the store {objects.uri}", config.get("format_version"), STORE_FORMAT_VERSION)
    return config


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
