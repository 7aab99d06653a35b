"""Every object name in a store, and parsing names back: the one place that knows the namespaces.

A store holds::

    config.json                    the store config (format version, hash, codec)
    blobs/<ab>/<key>               format 1: one tensor each, named by its content key (32 hex digits)
    packs/<ab>/<key>               format 2: one rank's tensors of one layer each (``format.pack``)
    files/<ab>/<key>               one auxiliary file each (config.json, tokenizer files...)
    manifests/<step, 12 digits>.json   one per committed step: its StepRecord (``format.manifest``;
                                   JSON text in format 1, a CKPM binary in format 2)
    manifests/<step>.<generation>.json  the step's record as gc rewrote it (weights-only steps,
                                   ``ckptstore.thin``); the highest generation is the step's record

Names are built and parsed here only, and a name is valid only if building it again from what
was parsed gives the same name. Anything else under a known prefix is *stray*: listings
report it beside the valid names so that callers (verify, gc, catalog sync) can say so
instead of guessing what it is.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from ..objects import ObjectInfo, ObjectStore

CONFIG = "config.json"
BLOBS = "blobs/"
PACKS = "packs/"
FILES = "files/"
MANIFESTS = "manifests/"
# A local tier's record of the store it fronts (``tier.pairing``), written before its config.
TIER_REMOTE = "tier/remote.json"

_KEY = re.compile(r"[0-9a-f]{32}")
_STEP = re.compile(r"[0-9]{12,}")

T = TypeVar("T")


def _keyed(prefix: str, key: str) -> str:
    return f"{prefix}{key[:2]}/{key}"


def blob_name(key: str) -> str:
    """Object name of the blob with content key ``key``."""
    return _keyed(BLOBS, key)


def pack_name(key: str) -> str:
    """Object name of the pack with key ``key``."""
    return _keyed(PACKS, key)


def file_name(key: str) -> str:
    """Object name of the stored auxiliary file with content key ``key``."""
    return _keyed(FILES, key)


def manifest_name(step: int, generation: int = 0) -> str:
    """Object name of ``step``'s manifest (zero-padded so that names sort by step); generation
    0 is the commit's, each later one a rewrite by gc. Every name is written once (create-only)."""
    return f"{MANIFESTS}{step:012d}.json" if generation == 0 else f"{MANIFESTS}{step:012d}.{generation}.json"


def _parse_keyed(prefix: str, name: str) -> str | None:
    key = name.rsplit("/", 1)[-1]
    return key if _KEY.fullmatch(key) and name == _keyed(prefix, key) else None


def parse_blob_name(name: str) -> str | None:
    """The content key a valid blob name holds; None for anything else."""
    return _parse_keyed(BLOBS, name)


def parse_pack_name(name: str) -> str | None:
    """The key a valid pack name holds; None for anything else."""
    return _parse_keyed(PACKS, name)


def parse_file_name(name: str) -> str | None:
    """The content key a valid auxiliary-file name holds; None for anything else."""
    return _parse_keyed(FILES, name)


def parse_manifest_name(name: str) -> tuple[int, int] | None:
    """The (step, generation) a valid manifest name holds; None for anything else."""
    if not name.startswith(MANIFESTS) or not name.endswith(".json"):
        return None
    digits, _, generation = name[len(MANIFESTS) : -len(".json")].partition(".")
    if not _STEP.fullmatch(digits) or not (generation == "" or generation.isdigit()):
        return None
    parsed = (int(digits), int(generation or 0))
    return parsed if manifest_name(*parsed) == name else None


@dataclass
class Listing(Generic[T]):
    """The objects under one prefix: valid ones by what their name holds, and stray names."""

    found: dict[T, ObjectInfo] = field(default_factory=dict)
    stray: list[str] = field(default_factory=list)

    def missing(self, referenced: Iterable[T]) -> list[T]:
        """The referenced ones that are not stored, sorted."""
        return sorted(set(referenced) - set(self.found))

    def unreferenced(self, referenced: Iterable[T]) -> dict[T, ObjectInfo]:
        """The stored ones nothing in ``referenced`` names."""
        referenced = set(referenced)
        return {key: info for key, info in self.found.items() if key not in referenced}


def _listing(objects: ObjectStore, prefix: str, parse: Callable[[str], T | None]) -> Listing[T]:
    listing: Listing[T] = Listing()
    for info in objects.list(prefix):
        parsed = parse(info.name)
        if parsed is None:
            listing.stray.append(info.name)
        else:
            listing.found[parsed] = info
    listing.stray.sort()
    return listing


def list_blobs(objects: ObjectStore) -> Listing[str]:
    """Every stored blob by content key, and the stray names under ``blobs/``."""
    return _listing(objects, BLOBS, parse_blob_name)


def list_packs(objects: ObjectStore) -> Listing[str]:
    """Every stored pack by key, and the stray names under ``packs/``."""
    return _listing(objects, PACKS, parse_pack_name)


def list_files(objects: ObjectStore) -> Listing[str]:
    """Every stored auxiliary file by content key, and the stray names under ``files/``."""
    return _listing(objects, FILES, parse_file_name)


@dataclass
class ManifestListing(Listing[int]):
    """The manifests by step (``found``: each step's newest generation), and their generations."""

    generations: dict[int, list[int]] = field(default_factory=dict)

    def generation(self, step: int) -> int:
        """The generation of ``step``'s record (its newest manifest)."""
        return self.generations[step][-1]


def generations_of(objects: ObjectStore, step: int) -> list[int]:
    """The generations of ``step``'s manifests in ``objects``, ascending (one listing of the step's names)."""
    found = (parse_manifest_name(info.name) for info in objects.list(f"{MANIFESTS}{step:012d}."))
    return sorted(parsed[1] for parsed in found if parsed is not None and parsed[0] == step)


def list_manifests(objects: ObjectStore) -> ManifestListing:
    """Every step's newest manifest by step, every generation found, and the stray names."""
    by_name = _listing(objects, MANIFESTS, parse_manifest_name)
    listing = ManifestListing(stray=by_name.stray)
    for (step, generation), info in sorted(by_name.found.items()):
        listing.found[step] = info  # sorted: the newest generation wins
        listing.generations.setdefault(step, []).append(generation)
    return listing
