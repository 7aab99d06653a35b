"""All knowledge of PyTorch Distributed Checkpoint (DCP): what its state-dict items are in the
store's vocabulary (``naming``) and its ``Metadata`` as plain JSON (``metadata``).

The front door itself, DCP's ``StorageWriter``/``StorageReader``, is ``integrations.dcp``.
"""

from __future__ import annotations

import json

from ..errors import CorruptError

# ``format`` of a step description written through DCP (DeepSpeed's descriptions have none).
DCP_FORMAT = "dcp"


def is_dcp_step(description: str | dict) -> bool:
    """Whether a step description (JSON text or data) is that of a step saved through DCP."""
    if isinstance(description, str):
        description = json.loads(description)
    return isinstance(description, dict) and description.get("format") == DCP_FORMAT


def item_names(description: dict) -> dict[str, tuple[str, str, str]]:
    """A DCP step's items, in the state dict's order -> ``(stored name, kind, layer)``
    (``naming``). CorruptError if the description's list of them is malformed."""
    try:
        return {
            str(fqn): (str(name), str(kind), str(layer)) for fqn, name, kind, layer in description["names"]
        }
    except (KeyError, TypeError, ValueError):
        raise CorruptError("a DCP step's description does not name its items") from None
