"""tools/netproxy.py: a loopback proxy between boto3 and moto that throttles and cuts the link.

Real traffic goes through a real proxy to the session's moto server; the throttle's arithmetic
is checked on the token bucket with an injected clock (tests never assert wall-clock times).
"""

from __future__ import annotations

import os
import threading
import time

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import ConnectionClosedError, EndpointConnectionError

from tools.netproxy import Proxy, TokenBucket, chunk_size, parse_rate

# What boto3 shows when the proxy resets a connection (before or during a request).
CONNECTION_ERRORS = (ConnectionClosedError, EndpointConnectionError)
HEADERS = 16 * 1024  # generous bound on HTTP request/response headers around a body
# One session for every client: a session caches the loaded S3 model, a new one reloads it.
SESSION = boto3.session.Session()


def proxy_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("netproxy-")]


@pytest.fixture
def proxy(s3_server):
    endpoint, _ = s3_server
    with Proxy.for_endpoint(endpoint) as proxy:
        yield proxy
    assert proxy_threads() == []  # stop() joined every thread it started


def client_via(proxy: Proxy):
    """A plain boto3 client through the proxy that fails at the first error instead of retrying."""
    return SESSION.client(
        "s3",
        endpoint_url=proxy.endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        config=Config(retries={"total_max_attempts": 1}, connect_timeout=2, read_timeout=2),
    )


def test_put_and_get_round_trip_bytes_through_the_proxy(proxy, s3):
    body = os.urandom(1024 * 1024 + 17)
    client = client_via(proxy)
    client.put_object(Bucket=s3.bucket, Key="k", Body=body)
    assert s3.client.get_object(Bucket=s3.bucket, Key="k")["Body"].read() == body
    assert client.get_object(Bucket=s3.bucket, Key="k")["Body"].read() == body


def test_counters_count_body_bytes_per_direction(proxy, s3):
    body = os.urandom(512 * 1024)
    client = client_via(proxy)
    client.put_object(Bucket=s3.bucket, Key="k", Body=body)
    assert len(body) <= proxy.bytes_up < len(body) + HEADERS
    assert proxy.bytes_down < HEADERS

    proxy.reset_counters()
    assert (proxy.bytes_up, proxy.bytes_down) == (0, 0)
    client.get_object(Bucket=s3.bucket, Key="k")["Body"].read()
    assert proxy.bytes_up < HEADERS
    assert len(body) <= proxy.bytes_down < len(body) + HEADERS


def test_requests_lists_each_http_request_sent_through_it_once(proxy, s3):
    client = client_via(proxy)
    body = os.urandom(300_000)  # many chunks: a request line is found whichever chunk it ends in
    client.put_object(Bucket=s3.bucket, Key="packs/ab/k", Body=body)
    client.get_object(Bucket=s3.bucket, Key="packs/ab/k")["Body"].read()
    client.head_object(Bucket=s3.bucket, Key="packs/ab/k")
    assert proxy.requests[-3:] == [
        f"PUT /{s3.bucket}/packs/ab/k", f"GET /{s3.bucket}/packs/ab/k", f"HEAD /{s3.bucket}/packs/ab/k"
    ]  # fmt: skip
    proxy.reset_counters()
    assert proxy.requests == []


def test_cut_makes_calls_fail_with_a_connection_error_and_restore_heals(proxy, s3):
    client = client_via(proxy)
    client.put_object(Bucket=s3.bucket, Key="k", Body=b"before")  # a pooled keep-alive connection

    proxy.cut()
    with pytest.raises(CONNECTION_ERRORS):
        client.get_object(Bucket=s3.bucket, Key="k")
    with pytest.raises(CONNECTION_ERRORS):
        client_via(proxy).put_object(Bucket=s3.bucket, Key="new", Body=b"x")  # a fresh connection
    assert "new" not in s3.keys()

    proxy.restore()
    assert client.get_object(Bucket=s3.bucket, Key="k")["Body"].read() == b"before"
    client.put_object(Bucket=s3.bucket, Key="new", Body=b"after")
    assert s3.client.get_object(Bucket=s3.bucket, Key="new")["Body"].read() == b"after"


def test_cut_ends_a_throttled_upload_in_flight(proxy, s3):
    proxy.set_rate(64 * 1024)  # the 4 MiB body would need about a minute
    client = client_via(proxy)
    outcome: list[BaseException | None] = []

    def upload() -> None:
        try:
            client.put_object(Bucket=s3.bucket, Key="big", Body=os.urandom(4 * 1024 * 1024))
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    uploader = threading.Thread(target=upload)
    uploader.start()
    while proxy.bytes_up == 0 and uploader.is_alive():
        time.sleep(0.01)
    proxy.cut()
    uploader.join(timeout=30)  # a guard against a hang, not a timing assertion
    assert not uploader.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], CONNECTION_ERRORS), outcome
    assert "big" not in s3.keys()


def test_a_throttled_proxy_forwards_the_same_bytes_and_can_be_unthrottled_live(s3_server, s3):
    endpoint, _ = s3_server
    body = os.urandom(200 * 1024)
    with Proxy.for_endpoint(endpoint, rate=2e6) as proxy:
        client = client_via(proxy)
        client.put_object(Bucket=s3.bucket, Key="k", Body=body)
        assert client.get_object(Bucket=s3.bucket, Key="k")["Body"].read() == body
        proxy.set_rate(None)
        assert client.get_object(Bucket=s3.bucket, Key="k")["Body"].read() == body
    assert proxy_threads() == []


def test_stop_resets_open_connections_and_leaves_no_thread(s3_server, s3):
    endpoint, _ = s3_server
    proxy = Proxy.for_endpoint(endpoint).start()
    client = client_via(proxy)
    client.put_object(Bucket=s3.bucket, Key="k", Body=b"x")  # leaves a keep-alive connection open
    assert proxy_threads() != []
    proxy.stop()
    assert proxy_threads() == []
    proxy.stop()  # idempotent


def test_a_connection_to_a_target_that_is_down_is_reset_at_once():
    with Proxy("127.0.0.1", 1) as proxy:  # nothing listens on port 1
        with pytest.raises(CONNECTION_ERRORS):
            client_via(proxy).list_buckets()
    assert proxy_threads() == []


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_token_bucket_starts_full_then_makes_callers_wait_for_the_rate():
    clock = FakeClock()
    bucket = TokenBucket(1000, burst=100, clock=clock)
    assert bucket.reserve(100) == 0.0
    assert bucket.reserve(100) == pytest.approx(0.1)  # nothing taken while it says wait
    clock.now += 0.05
    assert bucket.reserve(100) == pytest.approx(0.05)
    clock.now += 0.05
    assert bucket.reserve(100) == 0.0


def test_token_bucket_never_saves_up_more_than_its_burst():
    clock = FakeClock()
    bucket = TokenBucket(1000, burst=100, clock=clock)
    clock.now += 3600
    assert bucket.reserve(100) == 0.0
    assert bucket.reserve(1) > 0.0


def simulated_seconds(bucket: TokenBucket, clock: FakeClock, total: int, chunk: int) -> float:
    """Send ``total`` bytes in ``chunk``s, sleeping (on the fake clock) as the bucket says."""
    start, sent = clock.now, 0
    while sent < total:
        wait = bucket.reserve(chunk)
        if wait:
            clock.now += wait
        else:
            sent += chunk
    return clock.now - start


@pytest.mark.parametrize("chunk", [100, 1000, 5000])  # below, at and above the burst
def test_token_bucket_averages_to_its_rate_whatever_the_chunk_size(chunk):
    clock = FakeClock()
    bucket = TokenBucket(10_000, burst=1000, clock=clock)
    # The first burst is free; every later byte costs 1/rate seconds.
    elapsed = simulated_seconds(bucket, clock, 1_000_000, chunk)
    assert elapsed == pytest.approx((1_000_000 - max(chunk, 1000)) / 10_000, rel=0.01)


def test_token_bucket_rate_changes_apply_at_once():
    clock = FakeClock()
    bucket = TokenBucket(1000, burst=100, clock=clock)
    bucket.reserve(100)
    assert bucket.reserve(100) == pytest.approx(0.1)
    bucket.set_rate(10_000, burst=100)
    assert bucket.reserve(100) == pytest.approx(0.01)
    bucket.set_rate(None)
    assert all(bucket.reserve(10**9) == 0.0 for _ in range(3))
    bucket.set_rate(1000, burst=100)  # back from unthrottled: full, as at creation
    assert bucket.reserve(100) == 0.0
    with pytest.raises(ValueError):
        bucket.set_rate(0)


def test_token_bucket_take_gives_up_when_its_caller_is_no_longer_alive():
    bucket = TokenBucket(1, burst=1)
    assert bucket.take(1)
    alive = [True]
    taker = threading.Thread(target=lambda: alive.append(bucket.take(1, lambda: alive[0])))
    taker.start()  # would wait about a second for the token
    alive[0] = False
    bucket.wake()
    taker.join(timeout=30)
    assert alive[1:] == [False]


def test_chunks_are_about_50ms_of_the_rate_within_1_to_64_kib():
    assert chunk_size(None) == 64 * 1024
    assert chunk_size(1e9) == 64 * 1024
    assert chunk_size(200_000) == 10_000
    assert chunk_size(10) == 1024


def test_parse_rate_reads_units_and_none():
    assert parse_rate("4MB") == 4e6
    assert parse_rate("512KiB/s") == 512 * 1024
    assert parse_rate("1e6") == 1e6
    assert parse_rate("2.5 mb") == 2.5e6
    assert parse_rate("none") is None
    assert parse_rate("0") is None
    with pytest.raises(ValueError):
        parse_rate("fast")
