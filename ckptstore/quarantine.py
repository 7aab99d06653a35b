"""``verify --quarantine``: the way past a manifest the store cannot read or authenticate.

gc refuses to run while a step's manifest cannot be read (it cannot tell which packs the step
needs) and while the newest deletion record cannot be read (``format.deletions``): the safe
answer, which leaves the operator stuck until the object goes. Quarantine moves each such
object aside: copied to ``quarantine/<its name>`` (create-only; a name taken by other bytes
gets ``.1``, ``.2``, ...) and only then deleted, so it is kept, never lost. Nothing reads
``quarantine/``: what is there is no step, and gc leaves it alone. Each object is read again
before it moves, and one that has become readable since verify looked stays where it is; one
a newer ckptstore wrote (UnsupportedError) is never moved.

Once moved, a step that only that manifest named is gone, and gc frees the packs only it needed
(after the grace period): quarantine is for objects the operator does not recognise.
"""

from __future__ import annotations

from .catalog.sync import read_manifest
from .errors import CorruptError, NotFoundError, UnsupportedError
from .format import deletions, layout
from .objects import ObjectStore

QUARANTINE = "quarantine/"


def move_aside(objects: ObjectStore, names: list[str]) -> dict[str, str]:
    """Move each of ``names`` (manifests or deletion records ``verify`` named unreadable) to
    ``quarantine/``; returns what moved: name -> where it is now. Objects gone since, or
    readable now, are left out. Raises what ``objects`` raises (StorageError); an object is
    deleted only once its copy is written."""
    moved = {}
    for name in names:
        try:
            data = objects.get(name)
            if _readable(objects, name, data):
                continue
        except NotFoundError:
            continue  # gone since verify listed it
        target = _free_name(objects, f"{QUARANTINE}{name}", data)
        objects.delete(name)
        moved[name] = target
    return moved


def _readable(objects: ObjectStore, name: str, data: bytes) -> bool:
    """Whether ``name`` reads (and, with a key, authenticates) as what its name says, or was
    written by a newer ckptstore."""
    try:
        parsed = layout.parse_manifest_name(name)
        if parsed is not None:
            read_manifest(objects, *parsed)
        elif layout.parse_deletions_name(name) is not None:
            deletions.decode(data, objects.content_hash, name)
        else:
            return True  # not a name quarantine moves
    except UnsupportedError:
        return True
    except CorruptError:
        return False
    return True


def _free_name(objects: ObjectStore, base: str, data: bytes) -> str:
    """Where ``data`` is now kept under ``base``: written create-only there or, where other
    bytes hold that name, under the first free ``base.N``."""
    target, n = base, 0
    while not objects.put_if_absent(target, data) and objects.get(target) != data:
        n += 1
        target = f"{base}.{n}"
    return target
