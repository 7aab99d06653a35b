"""All knowledge of PyTorch Distributed Checkpoint (DCP): what its state-dict items are in the
store's vocabulary (``naming``) and its ``Metadata`` as plain JSON (``metadata``).

DCP's ``StorageWriter`` and ``StorageReader`` are ``writer.StoreWriter`` and
``reader.StoreReader``; users import them from their front door, ``integrations.dcp``.
"""

from __future__ import annotations

import json
from typing import Protocol

from ..catalog import Catalog
from ..errors import CorruptError
from ..model import DCP_DOOR, front_door
from ..objects import ObjectStore

# ``format`` of a step description written through DCP (DeepSpeed's descriptions have none).
DCP_FORMAT = DCP_DOOR


class StoreParts(Protocol):
    """What the DCP writer and reader use of a ``Store``: its objects and its catalog.

    A protocol, not ``Store`` itself: ``store`` sits above this package's layer
    (``tests/test_architecture.py``), and every ``Store`` has both.
    """

    objects: ObjectStore
    catalog: Catalog


def is_dcp_step(description: str | dict) -> bool:
    """Whether a step description (JSON text or data) is that of a step saved through DCP."""
    return front_door(description) == DCP_DOOR


def dcp_description(catalog: Catalog, step: int) -> dict | None:
    """Step ``step``'s description, parsed, if the step was saved through DCP; None if not (a
    DeepSpeed engine committed it). Callers that route on it hand the parsed form on, so it
    is parsed once. NotFoundError for an unknown step."""
    description = json.loads(catalog.description(step))
    return description if is_dcp_step(description) else None


def item_names(description: dict) -> dict[str, tuple[str, str, str]]:
    """A DCP step's items, in the state dict's order -> ``(stored name, kind, layer)``
    (``naming``). CorruptError if the description's list of them is malformed."""
    try:
        return {
            str(fqn): (str(name), str(kind), str(layer)) for fqn, name, kind, layer in description["names"]
        }
    except (KeyError, TypeError, ValueError):
        raise CorruptError("a DCP step's description does not name its items") from None
