"""Which remote store a local tier fronts: ``tier/remote.json`` in the tier's directory.

Written when the tier is first opened in front of a store, and checked on every later open, so
one directory never mixes two stores' steps; ``ckptstore drain --local PATH`` reads it to know
where to upload after a crash.
"""

from __future__ import annotations

import json

from ..errors import BadInputError, CorruptError, NotFoundError
from ..format.layout import TIER_REMOTE as REMOTE
from ..objects import ObjectStore


def pair(local: ObjectStore, remote_uri: str, endpoint: str | None) -> None:
    """Record that ``local`` fronts ``remote_uri`` (at ``endpoint``), or check that it already
    does; BadInputError naming both if the tier fronts another store."""
    record = json.dumps({"remote": remote_uri, "endpoint": endpoint}, sort_keys=True).encode()
    if local.put_if_absent(REMOTE, record):
        return
    paired, paired_endpoint = paired_remote(local)
    if paired != remote_uri:
        raise BadInputError(
            f"{local.uri} is the local tier of {paired}, not of {remote_uri}: give each store its own local directory"
        )
    if endpoint is not None and paired_endpoint is not None and endpoint != paired_endpoint:
        raise BadInputError(f"{local.uri} fronts {paired} at {paired_endpoint}, not at {endpoint}")


def paired_remote(local: ObjectStore) -> tuple[str, str | None]:
    """``(remote URI, endpoint or None)`` the tier ``local`` fronts. NotFoundError if ``local`` is
    no local tier, CorruptError if its record cannot be read."""
    try:
        data = local.get(REMOTE)
    except NotFoundError:
        raise NotFoundError(f"{local.uri} is not a local tier (it has no {REMOTE})") from None
    try:
        record = json.loads(data)
        remote, endpoint = record["remote"], record.get("endpoint")
    except (ValueError, KeyError, TypeError, AttributeError):
        raise CorruptError(f"{local.uri}/{REMOTE} is not a tier record") from None
    if not isinstance(remote, str) or not (endpoint is None or isinstance(endpoint, str)):
        raise CorruptError(f"{local.uri}/{REMOTE} is not a tier record")
    return remote, endpoint
