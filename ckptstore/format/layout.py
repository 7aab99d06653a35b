"""Every object name in a store, and parsing names back: the one place that knows the namespaces.

A store holds::

    config.json                    the store config (format version, hash, codec)
    blobs/<ab>/<key>               format 1: one tensor each, named by its content key (32 hex digits)
    packs/<ab>/<key>               format 2: one rank's tensors of one layer each (``format.pack``)
    files/<ab>/<key>               one auxiliary file each (config.json, tokenizer files...)
    manifests/<step, 12 digits>.json   one per committed step: its StepRecord (``format.manifest``;
                                   JSON text in format 1, a CKPM binary in format 2)
    manifests/<step>.<generation>.json  a newer record of the step: gc rewrote it (weights-only
                                   steps, ``ckptstore.thin``) or the step was committed again after
                                   a deletion; the highest live generation is the step's record
    manifests/deleted.<sequence>   the store's deletion record (``format.deletions``): every
                                   deleted step's newest generation, so that no name is reused

Steps, generations and sequence numbers are ASCII digits below 2**63 (SQLite's integers); a
step has 12 digits at least (zero-padded), a generation none leading.

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
# [0-9], never \d or str.isdigit: those take other scripts' digits ("²"), which int() refuses.
_STEP = re.compile(r"[0-9]{12,19}")
_GENERATION = re.compile(r"[1-9][0-9]{0,18}")
LIMIT = 2**63  # steps, generations and sequence numbers are below it
DELETIONS = f"{MANIFESTS}deleted."
_NUMBER = re.compile(r"[0-9]{1,19}")

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


def deletions_name(sequence: int) -> str:
    """Object name of the store's deletion record number ``sequence`` (``format.deletions``)."""
    return f"{DELETIONS}{sequence:012d}"


def _number(text: str, pattern: re.Pattern) -> int | None:
    """The number ``text`` spells if ``pattern`` takes it whole and it is below ``LIMIT``."""
    if not pattern.fullmatch(text):
        return None
    value = int(text)
    return value if value < LIMIT else None


def parse_number(text: str) -> int | None:
    """The number ``text`` spells in ASCII digits, if it is below ``LIMIT``; None for anything
    else (``str.isdigit`` takes "²", which ``int`` refuses)."""
    return _number(text, _NUMBER)


def parse_manifest_name(name: str) -> tuple[int, int] | None:
    """The (step, generation) a valid manifest name holds; None for anything else."""
    if not name.startswith(MANIFESTS) or not name.endswith(".json"):
        return None
    digits, dot, generation = name[len(MANIFESTS) : -len(".json")].partition(".")
    step = _number(digits, _STEP)
    number = _number(generation, _GENERATION) if dot else 0
    if step is None or number is None:
        return None
    return (step, number) if manifest_name(step, number) == name else None


def parse_deletions_name(name: str) -> int | None:
    """The sequence number a valid deletion-record name holds; None for anything else."""
    if not name.startswith(DELETIONS):
        return None
    sequence = _number(name[len(DELETIONS) :], _STEP)
    return sequence if sequence is not None and deletions_name(sequence) == name else None


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
    """The manifests by step (``found``: each step's newest generation), and their generations.

    As ``list_manifests`` returns it, every name is counted; ``format.deletions.list_manifests``
    leaves out the generations a deletion buried (``buried``: their names) and says which
    steps were deleted at which generation (``deleted``)."""

    generations: dict[int, list[int]] = field(default_factory=dict)
    deletion_records: dict[int, ObjectInfo] = field(default_factory=dict)  # by sequence number
    deleted: dict[int, int] = field(default_factory=dict)
    buried: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # deletion records passed over, and why
    unreadable: list[str] = field(default_factory=list)  # their names

    def generation(self, step: int) -> int:
        """The generation of ``step``'s record (its newest manifest)."""
        return self.generations[step][-1]


def generations_of(objects: ObjectStore, step: int) -> list[int]:
    """The generations of ``step``'s manifests in ``objects``, ascending (one listing of the step's names)."""
    found = (parse_manifest_name(info.name) for info in objects.list(f"{MANIFESTS}{step:012d}."))
    return sorted(parsed[1] for parsed in found if parsed is not None and parsed[0] == step)


def list_manifests(objects: ObjectStore) -> ManifestListing:
    """Every step's newest manifest by step, every generation found, the deletion records, and
    the stray names; deletions not applied (``format.deletions.list_manifests`` applies them)."""

    def parse(name: str) -> tuple[int, int] | int | None:
        return parse_manifest_name(name) if name.endswith(".json") else parse_deletions_name(name)

    by_name = _listing(objects, MANIFESTS, parse)
    listing = ManifestListing(stray=by_name.stray)
    manifests = {}
    for parsed, info in by_name.found.items():
        if isinstance(parsed, tuple):
            manifests[parsed] = info
        else:
            listing.deletion_records[parsed] = info
    for (step, generation), info in sorted(manifests.items(), key=lambda item: item[0]):
        listing.found[step] = info  # sorted: the newest generation wins
        listing.generations.setdefault(step, []).append(generation)
    return listing
