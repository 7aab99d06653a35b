"""A loopback TCP proxy that throttles bandwidth and simulates outages, for tests and benchmarks.

    python -m tools.netproxy --target http://127.0.0.1:PORT [--rate 4MB] [--port 0]

It sits between a boto3 client and a (moto) S3 server and forwards bytes unchanged, so the
client and server speak real HTTP to each other::

    with Proxy.for_endpoint(moto_endpoint, rate=4e6) as proxy:
        client = boto3.client("s3", endpoint_url=proxy.endpoint, ...)
        proxy.cut()      # outage: open connections are reset, new ones are reset on arrival
        proxy.restore()  # back to normal

Throttling is a token bucket per direction (client->server "up", server->client "down"),
shared by every connection, so ``rate`` bounds the aggregate like a slow link would, not each
connection. Bytes move in small chunks (at most 64 KiB, about 50 ms worth at the rate) so the
flow is smooth rather than bursty. The kernel's socket buffers still sit between the client and
the proxy: a client may have handed a few MB more to its socket than the server has received,
but a request only completes once the server has it, so end-to-end times follow the rate.

Standard library only, two threads per connection (one per direction) and one accepting.
"""

from __future__ import annotations

import argparse
import re
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from urllib.parse import urlsplit

MAX_CHUNK = 64 * 1024
MIN_CHUNK = 1024
# How often the accept loop looks at the stop flag: closing a listening socket does not wake a
# thread blocked in accept() on every platform, a timeout does.
ACCEPT_POLL_S = 0.05
CONNECT_TIMEOUT_S = 5.0


def chunk_size(rate: float | None) -> int:
    """Bytes read per step: about 50 ms worth at ``rate``, between 1 KiB and 64 KiB."""
    if rate is None:
        return MAX_CHUNK
    return int(min(MAX_CHUNK, max(MIN_CHUNK, rate / 20)))


class TokenBucket:
    """A thread-safe token bucket: ``rate`` tokens (bytes) per second, at most ``burst`` saved up.

    ``rate=None`` is unthrottled. ``burst`` defaults to one chunk at the rate. A request for
    more than ``burst`` is let through once the bucket is full and leaves it in debt, so large
    requests still average out to ``rate``. ``clock`` is injectable so the arithmetic can be
    tested without sleeping.
    """

    def __init__(
        self, rate: float | None, *, burst: float | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._cond = threading.Condition()
        self._clock = clock
        self._rate: float | None = None
        self._burst = 0.0
        self._tokens = 0.0
        self._last = clock()
        self.set_rate(rate, burst=burst)  # starts full: the first chunk goes at once

    @property
    def rate(self) -> float | None:
        return self._rate

    def set_rate(self, rate: float | None, *, burst: float | None = None) -> None:
        """Change the rate now; tokens earned so far at the old rate are kept (up to the new burst).

        Wakes every thread waiting in ``take`` so it re-plans at the new rate.
        Raises ValueError unless ``rate`` is None or positive.
        """
        if rate is not None and not rate > 0:
            raise ValueError(f"rate must be positive or None, not {rate!r}")
        with self._cond:
            self._refill()
            was_unthrottled = self._rate is None
            self._rate = rate
            self._burst = float(burst if burst is not None else chunk_size(rate))
            # Nothing accrues while unthrottled, so coming out of it starts full, as at creation.
            self._tokens = self._burst if was_unthrottled else min(self._tokens, self._burst)
            self._cond.notify_all()

    def reserve(self, n: int) -> float:
        """Take ``n`` tokens and return 0.0 if they are there; else take nothing and return the seconds
        until they will be (at the current rate). Never blocks."""
        with self._cond:
            return self._reserve(n)

    def take(self, n: int, alive: Callable[[], bool] = lambda: True) -> bool:
        """Block until ``n`` tokens are taken (True), or ``alive()`` turns false (False, nothing taken).

        ``alive`` is checked on every wake-up; call ``wake()`` after making it false.
        """
        with self._cond:
            while alive():
                wait = self._reserve(n)
                if wait == 0.0:
                    return True
                self._cond.wait(wait)
            return False

    def wake(self) -> None:
        """Wake every thread blocked in ``take`` to re-check its ``alive``."""
        with self._cond:
            self._cond.notify_all()

    def _refill(self) -> None:
        now = self._clock()
        if self._rate is not None:
            self._tokens = min(self._burst, self._tokens + (now - self._last) * self._rate)
        self._last = now

    def _reserve(self, n: int) -> float:
        if self._rate is None:
            return 0.0
        self._refill()
        need = min(float(n), self._burst)
        wait = (need - self._tokens) / self._rate
        # Float rounding can leave a shortfall of a few ulps that no clock tick would ever make
        # up (a spin); a nanosecond's worth is as good as there.
        if wait <= 1e-9:
            self._tokens -= n
            return 0.0
        return wait


def _reset(sock: socket.socket) -> None:
    """Make the socket's close send RST, and shut it down so threads blocked on it wake up."""
    try:
        # SO_LINGER with a zero timeout: close() aborts with RST instead of a graceful FIN, so
        # the peer (urllib3 under boto3) gets "connection reset" at once instead of waiting.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class _Connection:
    """One proxied client connection: a thread per direction; the last one out closes both sockets."""

    def __init__(self, proxy: Proxy, client: socket.socket) -> None:
        self.proxy = proxy
        self.client = client
        self.upstream: socket.socket | None = None
        self.dead = False
        self._lock = threading.Lock()
        self._running = 2
        self._seen = b""  # the last bytes sent up, where a request line may have begun

    def kill(self) -> None:
        # Under the lock, so a socket is never shut down while _done closes it: a closed
        # descriptor's number can be reused at once by another connection's socket.
        with self._lock:
            self.dead = True
            for sock in (self.client, self.upstream):
                if sock is not None:
                    _reset(sock)

    def alive(self) -> bool:
        return not self.dead

    def run_up(self) -> None:
        try:
            upstream = socket.create_connection(self.proxy.target, timeout=CONNECT_TIMEOUT_S)
            upstream.settimeout(None)
            upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            self.kill()  # the server is down: the client sees a reset, as it would without us
            self._done()
            self._done()  # the down direction never starts
            return
        with self._lock:
            self.upstream = upstream
            dead = self.dead
            if dead:  # cut() or stop() came while connecting
                _reset(upstream)
        if dead:
            self._done()
            self._done()
            return
        if not self.proxy._spawn(self.run_down, "down"):
            self.kill()
            self._done()
        self._pump(self.client, upstream, "up")

    def run_down(self) -> None:
        assert self.upstream is not None
        self._pump(self.upstream, self.client, "down")

    def _pump(self, src: socket.socket, dst: socket.socket, direction: str) -> None:
        bucket = self.proxy._buckets[direction]
        try:
            while not self.dead:
                data = src.recv(chunk_size(bucket.rate))
                if not data:
                    # Half-close: the HTTP peer finished sending; the other direction may still flow.
                    dst.shutdown(socket.SHUT_WR)
                    break
                if not bucket.take(len(data), self.alive):
                    break
                # Counted before it is passed on: a client that has read a reply whole then
                # finds every byte of it counted (after, the count could lag what it read).
                self.proxy._count(direction, len(data))
                if direction == "up":
                    self._seen = self.proxy._note_requests(self._seen, data)
                dst.sendall(data)
        except OSError:
            self.kill()
        finally:
            self._done()

    def _done(self) -> None:
        with self._lock:
            self._running -= 1
            last = self._running == 0
            if last:
                for sock in (self.client, self.upstream):
                    if sock is not None:
                        sock.close()
        if last:
            self.proxy._forget(self)


class Proxy:
    """A TCP proxy on 127.0.0.1 forwarding to ``target_host:target_port``.

    ``rate`` is bytes per second per direction (None: unthrottled), shared by all connections.
    ``start()`` binds and returns once connections are accepted; ``stop()`` resets every open
    connection and returns once every thread of the proxy has ended. Usable as a context manager.
    ``bytes_up`` / ``bytes_down`` count bytes forwarded client->server / server->client (HTTP
    headers included); ``requests`` lists the HTTP requests sent through it, ``"GET /bucket/key"``.
    """

    def __init__(
        self,
        target_host: str,
        target_port: int,
        *,
        rate: float | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.target = (target_host, target_port)
        self._bind = (host, port)
        self._buckets = {"up": TokenBucket(rate), "down": TokenBucket(rate)}
        self._lock = threading.Lock()
        self._threads: set[threading.Thread] = set()
        self._conns: set[_Connection] = set()
        self._listener: socket.socket | None = None
        self._endpoint: str | None = None
        self._stopping = False
        self._cut = False
        self.bytes_up = 0
        self.bytes_down = 0
        self.requests: list[str] = []

    @classmethod
    def for_endpoint(cls, endpoint: str, *, rate: float | None = None) -> Proxy:
        """A proxy to an ``http://host:port`` endpoint URL (as the ``s3_server`` fixture gives)."""
        parts = urlsplit(endpoint)
        if parts.hostname is None or parts.port is None:
            raise ValueError(f"endpoint needs a host and a port: {endpoint!r}")
        return cls(parts.hostname, parts.port, rate=rate)

    @property
    def endpoint(self) -> str:
        """``http://127.0.0.1:PORT``, for boto3's ``endpoint_url``. Only once started."""
        if self._endpoint is None:
            raise RuntimeError("the proxy is not started")
        return self._endpoint

    def start(self) -> Proxy:
        """Listen and accept in a background thread. Returns self. A proxy starts once only."""
        if self._listener is not None:
            raise RuntimeError("the proxy is already started")
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(self._bind)
        listener.listen(128)
        listener.settimeout(ACCEPT_POLL_S)
        self._listener = listener
        host, port = listener.getsockname()[:2]
        self._endpoint = f"http://{host}:{port}"
        self._spawn(self._accept_loop, "accept")
        return self

    def stop(self) -> None:
        """Reset every connection, close the listener and join every thread. Idempotent."""
        with self._lock:
            self._stopping = True
            conns = list(self._conns)
        for conn in conns:
            conn.kill()
        for bucket in self._buckets.values():
            bucket.wake()
        # No thread starts once _stopping is set, so this empties the set for good.
        while True:
            with self._lock:
                threads = [t for t in self._threads if t is not threading.current_thread()]
            if not threads:
                break
            for thread in threads:
                thread.join()
        if self._listener is not None:
            self._listener.close()

    def __enter__(self) -> Proxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def set_rate(self, rate: float | None) -> None:
        """Throttle both directions to ``rate`` bytes/s (None: unthrottled), effective at once."""
        for bucket in self._buckets.values():
            bucket.set_rate(rate)

    def cut(self) -> None:
        """Outage: reset every open connection, and reset new ones as soon as they are accepted.

        A client sees a connection error at once (reset), never a hang, until ``restore()``.
        """
        with self._lock:
            self._cut = True
            conns = list(self._conns)
        for conn in conns:
            conn.kill()
        for bucket in self._buckets.values():
            bucket.wake()  # a connection waiting for tokens ends now, not when they come

    def restore(self) -> None:
        """End the outage: new connections are forwarded again."""
        with self._lock:
            self._cut = False

    def reset_counters(self) -> None:
        with self._lock:
            self.bytes_up = 0
            self.bytes_down = 0
            self.requests = []

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stopping:
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                break
            client.settimeout(None)  # accepted sockets inherit the listener's timeout on some platforms
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Connection(self, client)
            with self._lock:
                refuse = self._cut or self._stopping
                if not refuse:
                    self._conns.add(conn)
            if refuse:
                _reset(client)
                client.close()
            elif not self._spawn(conn.run_up, "up"):
                _reset(client)
                client.close()
                self._forget(conn)

    def _spawn(self, target: Callable[[], None], role: str) -> bool:
        """Start a thread of this proxy unless it is stopping; False if it is."""

        def run() -> None:
            try:
                target()
            finally:
                with self._lock:
                    self._threads.discard(thread)

        with self._lock:
            if self._stopping:
                return False
            thread = threading.Thread(target=run, name=f"netproxy-{role}", daemon=True)
            self._threads.add(thread)
            thread.start()
        return True

    def _forget(self, conn: _Connection) -> None:
        with self._lock:
            self._conns.discard(conn)

    def _note_requests(self, seen: bytes, data: bytes) -> bytes:
        """Record the HTTP request lines that end in ``data`` (``seen``: the connection's last
        bytes before it, where a line may have begun); returns the new ``seen``."""
        buffer = seen + data
        lines = [
            f"{m[1].decode()} {m[2].decode()}" for m in _REQUEST_LINE.finditer(buffer) if m.end() > len(seen)
        ]
        if lines:
            with self._lock:
                self.requests.extend(lines)
        return buffer[-_LONGEST_LINE:]

    def _count(self, direction: str, n: int) -> None:
        with self._lock:
            if direction == "up":
                self.bytes_up += n
            else:
                self.bytes_down += n


# An HTTP/1.x request line, as a client starts each request on a connection.
_REQUEST_LINE = re.compile(rb"(?:^|\r\n)(GET|PUT|HEAD|POST|DELETE) (/[^ \r\n]*) HTTP/1\.[01]\r\n")
_LONGEST_LINE = 2048

_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 1024, "m": 1e6, "mb": 1e6, "mib": 1024**2}
_UNITS |= {"g": 1e9, "gb": 1e9, "gib": 1024**3}


def parse_rate(text: str) -> float | None:
    """``"4MB"`` -> 4e6, ``"512KiB/s"`` -> 524288.0, ``"none"`` / ``"0"`` -> None (unthrottled)."""
    match = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-z]*)\s*(?:/s)?\s*", text.lower())
    if match is None or match.group(2) not in _UNITS:
        if text.strip().lower() in ("none", "off", "unlimited"):
            return None
        raise ValueError(f"not a rate: {text!r} (examples: 4MB, 512KiB, 1e6, none)")
    rate = float(match.group(1)) * _UNITS[match.group(2)]
    return rate or None


def main(argv: list[str] | None = None) -> None:
    """Serve until SIGINT or SIGTERM, printing the endpoint first and the byte counts at the end."""
    parser = argparse.ArgumentParser(
        prog="python -m tools.netproxy",
        description="Forward 127.0.0.1:PORT to a target, throttled. Example: "
        "python -m tools.netproxy --target http://127.0.0.1:5000 --rate 4MB",
    )
    parser.add_argument("--target", required=True, help="http://host:port to forward to")
    parser.add_argument("--rate", default="none", help="bytes/s per direction: 4MB, 512KiB, none")
    parser.add_argument("--port", type=int, default=0, help="port to listen on (0: any free one)")
    args = parser.parse_args(argv)
    target = urlsplit(args.target)
    if target.hostname is None or target.port is None:
        parser.error(f"--target needs a host and a port: {args.target!r}")
    try:
        rate = parse_rate(args.rate)
    except ValueError as exc:
        parser.error(str(exc))
    done = threading.Event()
    # SIGTERM too: a shell script's background job ignores SIGINT, so Ctrl-C is not the only way out.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: done.set())
    with Proxy(target.hostname, target.port, rate=rate, port=args.port) as proxy:
        print(proxy.endpoint, flush=True)
        while not done.wait(1.0):
            pass
    print(f"up {proxy.bytes_up} bytes, down {proxy.bytes_down} bytes", file=sys.stderr)


if __name__ == "__main__":
    main()
