"""A real S3 endpoint for tests, and faults injected into botocore's request path.

* ``s3_server`` (session): moto's threaded server bound to 127.0.0.1 on a free port. It speaks
  real HTTP, so torchrun children reach it too (``AWS_ENDPOINT_URL`` is inherited).
* ``s3`` (per test): its own bucket, fake credentials, ``AWS_ENDPOINT_URL`` and an empty
  ``CKPTSTORE_CACHE`` in the environment, and a plain boto3 client to look at the bucket.
* ``inject_faults(client, ...)``: a botocore ``before-send`` hook that answers matching
  requests with an HTTP error or raises a connection error instead of sending them; every
  other request goes to the server unchanged. The client itself is never replaced or mocked.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import boto3
import pytest
from botocore.awsrequest import AWSResponse
from botocore.exceptions import ConnectionClosedError


@pytest.fixture(scope="session")
def s3_server():
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    admin = boto3.session.Session().client(
        "s3", endpoint_url=endpoint, region_name="us-east-1",
        aws_access_key_id="testing", aws_secret_access_key="testing",
    )  # fmt: skip
    yield endpoint, admin
    server.stop()


@dataclass
class S3:
    endpoint: str
    bucket: str
    client: object  # a plain boto3 client of the test's own, to inspect the bucket

    def uri(self, prefix: str = "run") -> str:
        return f"s3://{self.bucket}/{prefix}" if prefix else f"s3://{self.bucket}"

    def keys(self, prefix: str = "") -> list[str]:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
        return [item["Key"] for page in pages for item in page.get("Contents", [])]


# Fake credentials, isolated from the host's AWS config (children of a test take them in their env).
S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_CONFIG_FILE": "/nonexistent/aws-config",
    "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/aws-credentials",
}


def s3_environment(monkeypatch, endpoint: str, cache) -> None:
    """Credentials and endpoint for the loopback server, isolated from the host's AWS config."""
    for name, value in {**S3_ENV, "AWS_ENDPOINT_URL": endpoint, "CKPTSTORE_CACHE": str(cache)}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)


@pytest.fixture
def s3(s3_server, monkeypatch, tmp_path) -> S3:
    endpoint, admin = s3_server
    s3_environment(monkeypatch, endpoint, tmp_path / "cache")
    bucket = f"ckpt-{uuid.uuid4().hex[:16]}"
    admin.create_bucket(Bucket=bucket)
    return S3(endpoint, bucket, admin)


@pytest.fixture
def machine(monkeypatch, tmp_path):
    """Switch to the machine called ``name``: its own, initially empty, catalog cache (returned)."""

    def use(name: str):
        monkeypatch.setenv("CKPTSTORE_CACHE", str(tmp_path / f"cache-{name}"))
        return tmp_path / f"cache-{name}"

    return use


class _Body:
    def __init__(self, data: bytes) -> None:
        self.data = data

    def stream(self, **_):
        yield self.data


def error_response(url: str, status: int, code: str, message: str = "injected") -> AWSResponse:
    body = f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>{message}</Message></Error>'
    return AWSResponse(url, status, {"Content-Type": "application/xml"}, _Body(body.encode()))


@dataclass
class Faults:
    """Injected so far: how many requests each fault answered."""

    answered: int = 0
    seen: list[str] = field(default_factory=list)  # operations of every request that matched
    over: bool = False  # set it to let every later request through (the outage is over)


def inject_faults(
    client,
    operation: str,
    fault: str | tuple[int, str],
    *,
    times: int | None = 1,
    when: Callable[[object], bool] = lambda request: True,
) -> Faults:
    """Answer the next ``times`` (None: every) ``operation`` requests that ``when`` accepts.

    ``fault`` is ``"connection"`` (the connection drops) or ``(HTTP status, S3 error code)``.
    ``operation`` is a botocore operation name such as ``PutObject``, or ``*`` for all.
    """
    faults = Faults()

    def hook(request, **kwargs):
        if faults.over or not when(request):
            return None
        faults.seen.append(kwargs.get("event_name", ""))
        if times is not None and faults.answered >= times:
            return None
        faults.answered += 1
        if fault == "connection":
            raise ConnectionClosedError(endpoint_url=request.url)
        status, code = fault
        return error_response(request.url, status, code)

    event = "before-send.s3" if operation == "*" else f"before-send.s3.{operation}"
    client.meta.events.register(event, hook)
    return faults
