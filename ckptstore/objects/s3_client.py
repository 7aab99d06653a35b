"""What an S3 store is addressed by and talks through: its URI, its timeout, its boto3 client."""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlparse

import boto3
import botocore.loaders
import botocore.session
from botocore.config import Config

from .. import knobs, remote_knobs
from ..errors import BadInputError, clip, redact
from . import check_name

_LOADER = botocore.loaders.create_loader()
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """``(bucket, key prefix)`` of ``s3://bucket/some/prefix``; the prefix is "" or ends in "/"."""
    parsed = urlparse(uri)
    if parsed.scheme != "s3" or parsed.query or parsed.fragment or parsed.params:
        raise BadInputError(f"an S3 store URI looks like s3://bucket/prefix, not {uri!r}")
    bucket = parsed.netloc
    if not _BUCKET.match(bucket) or ".." in bucket:
        raise BadInputError(f"{bucket!r} in {uri!r} is not a valid S3 bucket name")
    prefix = parsed.path.strip("/")
    if prefix:
        check_name(prefix)
    return bucket, f"{prefix}/" if prefix else ""


def create_only(params: dict, **_: Any) -> None:
    # Every object S3ObjectStore writes is create-only; see its module's docstring.
    params.setdefault("IfNoneMatch", "*")


def new_client(endpoint_url: str | None, timeout: float):
    """A boto3 S3 client for ``endpoint_url`` (None: boto3's choice) in standard retry mode,
    connecting and reading with ``timeout`` seconds."""
    config = Config(
        retries={"mode": "standard", "total_max_attempts": remote_knobs.s3_max_attempts()},
        # botocore waits 60 s for a connection and for each read by default, and retries
        # those: an endpoint that never answers would stall each call for minutes.
        connect_timeout=timeout,
        read_timeout=timeout,
        # io_threads objects at once, each with up to s3_part_threads parts in flight.
        max_pool_connections=knobs.io_threads() * remote_knobs.s3_part_threads() + 4,
    )
    # A session per store (boto3's default session is not safe to share across threads),
    # sharing one loader: parsing the S3 service model costs 0.25 s per client otherwise.
    session = botocore.session.get_session()
    session.register_component("data_loader", _LOADER)
    if endpoint_url is not None and not isinstance(endpoint_url, str):
        raise BadInputError(f"endpoint_url must be a URL string, not {type(endpoint_url).__name__}")
    try:
        return boto3.session.Session(botocore_session=session).client(
            "s3", endpoint_url=endpoint_url, config=config
        )
    except ValueError as exc:  # botocore's "Invalid endpoint: ...", from endpoint_url= or AWS_ENDPOINT_URL
        where = (
            "endpoint_url" if endpoint_url is not None else "the S3 endpoint (AWS_ENDPOINT_URL or AWS config)"
        )
        raise BadInputError(
            f"{where} is not a URL like http://host:port: {clip(redact(str(exc)), 120)}"
        ) from None
