"""The store's deletion record: the last generation of every deleted step, so that no manifest
name is reused and a deleted step's manifest put back is not a step again.

Deleting a step (gc, ``Store.delete``) first writes a new deletion record, then deletes the
step's manifests. A record is ``manifests/deleted.<sequence>`` (create-only; each holds every
deletion of the one before it plus the new ones, and the two newest are kept): ``b"CKPD" u8 1``
then one zstd frame (with its checksum) of canonical JSON ``{"deleted": [[step, generation],
...]}``; in a store with a key ``u8 2``, a 32-byte tag binding the frame to the record's name
(``hashing.ContentHash.tag``), then the frame. A manifest of a deleted step at or below its
deleted generation is *buried*: not a step, reported by ``verify``. With a key the next gc
deletes it. Without one a record is anyone's word (``PutObject`` alone writes one), so it never
deletes a manifest or frees what one needs (``kept_buried``): a buried manifest stays, with
its packs, blobs and files, until a ``delete`` or gc that drops its step removes it, which
takes the right to delete. A step committed again is written at the generation above
(``next_generation``), and its record names the generation it supersedes
(``StepRecord.supersedes``), so that a deletion missing from the record shows.

Readers take the newest record they can read (with a key: authenticate); a newer one they
cannot is passed over and reported, and gc refuses to run past it. An older ckptstore sees the
records as stray names (its verify lists them, nothing else looks at them) and reads a step
committed again at its generation, but buries nothing: there, a deleted step's manifest put
back is a step again.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field

from .. import knobs
from ..errors import ConflictError, CorruptError, NotFoundError
from ..hashing import ContentHash
from ..objects import ObjectStore
from . import layout, zstd
from .config import check_version

MAGIC = b"CKPD"
VERSION = 1
AUTHENTICATED_VERSION = 2
TAG_BYTES = 32
_ATTEMPTS = 8  # gc runs that write a record at the same time take turns (create-only names)


@dataclass
class Deletions:
    """What the newest readable deletion record says: step -> its last generation."""

    deleted: dict[int, int] = field(default_factory=dict)
    sequence: int = -1  # the newest record listed (-1: none)
    problems: list[str] = field(default_factory=list)  # newer records passed over, and why
    unreadable: list[str] = field(default_factory=list)  # their names


def encode(deleted: dict[int, int], name: str, content_hash: ContentHash) -> bytes:
    """The bytes of a deletion record named ``name`` holding ``deleted`` (step -> generation)."""
    body = json.dumps({"deleted": sorted([s, g] for s, g in deleted.items())}, separators=(",", ":"))
    frame = zstd.compressor().compress(body.encode())
    if not content_hash.authenticated:
        return MAGIC + bytes([VERSION]) + frame
    return MAGIC + bytes([AUTHENTICATED_VERSION]) + content_hash.tag(name, frame) + frame


def decode(data: bytes, content_hash: ContentHash, name: str) -> dict[int, int]:
    """Step -> deleted generation from the record ``data`` read from ``name``. CorruptError
    (saying why) if malformed or, with a key, not authentic; UnsupportedError if newer."""
    data = bytes(data)
    if len(data) < 5 or data[:4] != MAGIC:
        raise CorruptError("is not a deletion record")
    if content_hash.authenticated:
        if data[4] != AUTHENTICATED_VERSION or len(data) < 5 + TAG_BYTES:
            raise CorruptError("is not authentic: it has no tag (it was written without the store's key)")
        tag, frame = data[5 : 5 + TAG_BYTES], data[5 + TAG_BYTES :]
        if not content_hash.tag_matches(name, frame, tag):
            raise CorruptError(
                "is not authentic: its tag does not match (written without the key, or changed)"
            )
    else:
        if data[4] == AUTHENTICATED_VERSION:
            raise CorruptError("is tagged, in a store without a key")
        check_version(f"deletion record {name}", data[4], AUTHENTICATED_VERSION)
        frame = data[5:]
    most = max(knobs.manifest_min_bound(), len(frame) * knobs.manifest_max_expansion())
    try:
        content = zstd.decompress_frame(frame, most)
    except CorruptError as exc:
        raise CorruptError(f"is damaged ({exc})") from None
    try:
        pairs = json.loads(content)["deleted"]
        deleted = {}
        for step, generation in pairs:
            if not all(type(n) is int and 0 <= n < layout.LIMIT for n in (step, generation)):
                raise ValueError(f"{step!r}, {generation!r}")
            deleted[step] = max(generation, deleted.get(step, -1))
    except (ValueError, TypeError, KeyError, RecursionError) as exc:
        raise CorruptError(f"is malformed ({type(exc).__name__})") from None
    return deleted


def read(objects: ObjectStore, sequences: Iterable[int]) -> Deletions:
    """The newest of the records ``sequences`` (listed in ``objects``) that can be read."""
    sequences = sorted(sequences, reverse=True)
    found = Deletions(sequence=sequences[0] if sequences else -1)
    for sequence in sequences:
        name = layout.deletions_name(sequence)
        try:
            found.deleted = decode(objects.get(name), objects.content_hash, name)
            return found
        except NotFoundError:
            continue  # replaced by a newer one since the listing
        except CorruptError as exc:
            found.problems.append(f"deletion record {name} {exc}")
            found.unreadable.append(name)
    return found


def list_manifests(objects: ObjectStore) -> layout.ManifestListing:
    """``layout.list_manifests`` with the deletions applied: a deleted step's manifests at or
    below its deleted generation are left out (named in ``buried``), and so is a step with no
    other; ``deleted`` and ``problems`` say what the record held and which were passed over."""
    listing = layout.list_manifests(objects)
    deletions = read(objects, listing.deletion_records)
    listing.deleted, listing.problems = deletions.deleted, deletions.problems
    listing.unreadable = deletions.unreadable
    for step, generations in list(listing.generations.items()):
        last = deletions.deleted.get(step, -1)
        listing.buried += [layout.manifest_name(step, g) for g in generations if g <= last]
        live = [g for g in generations if g > last]
        if live:
            listing.generations[step] = live  # the newest stays in found
        else:
            del listing.generations[step], listing.found[step]
    return listing


def kept_buried(
    listing: layout.ManifestListing, content_hash: ContentHash, going: Iterable[int] = ()
) -> list[str]:
    """The buried manifests of ``listing`` that stay, and keep what they need: in a store
    without a key, each one whose step is not in ``going`` (the steps a delete or gc drops
    now, whose manifests it removes itself); with a key (records authenticated), none."""
    if content_hash.authenticated:
        return []
    going = set(going)
    return [name for name in listing.buried if _step_of(name) not in going]


def buried_steps(listing: layout.ManifestListing) -> set[int]:
    """The steps ``listing`` has buried manifests of."""
    return {_step_of(name) for name in listing.buried}


def _step_of(name: str) -> int:
    parsed = layout.parse_manifest_name(name)
    assert parsed is not None, name  # buried names come from a listing's parsed names
    return parsed[0]


def _listed(objects: ObjectStore) -> list[int]:
    sequences = (layout.parse_deletions_name(info.name) for info in objects.list(layout.DELETIONS))
    return [s for s in sequences if s is not None]


def next_generation(objects: ObjectStore, known: Deletions | None, step: int, *, ask: bool = True) -> int:
    """The generation a new commit of ``step`` is written at: 0 for a step never deleted, else
    one above its deleted generation. ``known``: the record a sync read (``ask``: list the
    records again, and read the newest if it is newer). CorruptError past the last generation."""
    deletions = known or Deletions()
    if ask:
        listed = _listed(objects)
        if listed and max(listed) != deletions.sequence:
            deletions = read(objects, listed)
    last = deletions.deleted.get(step)
    if last is not None and last + 1 >= layout.LIMIT:
        raise CorruptError(f"step {step} has no generation left above {last} to be committed again at")
    return 0 if last is None else last + 1


def record(objects: ObjectStore, dropped: dict[int, int]) -> None:
    """Add ``dropped`` (step -> its newest generation) to the store's deletion record: a new
    record above every one listed, then the records older than the one before it deleted.
    CorruptError if the newest record cannot be read (its deletions would be lost), ConflictError
    if other writers keep taking the next name."""
    if not dropped:
        return
    for _ in range(_ATTEMPTS):
        listed = _listed(objects)
        current = read(objects, listed)
        if current.problems:
            raise CorruptError(
                f"{current.problems[0]}; gc will not write over a deletion record it cannot read "
                "(its deletions would be lost): run `ckptstore verify --quarantine`"
            )
        merged = dict(current.deleted)
        for step, generation in dropped.items():
            merged[step] = max(generation, merged.get(step, -1))
        sequence = current.sequence + 1
        if sequence >= layout.LIMIT:
            raise CorruptError("the deletion record has no sequence number left")
        name = layout.deletions_name(sequence)
        if objects.put_if_absent(name, encode(merged, name, objects.content_hash), single_request=True):
            objects.delete_many([layout.deletions_name(s) for s in listed if s < sequence - 1])
            return
    raise ConflictError("the deletion record kept changing while gc wrote it; run gc again")
