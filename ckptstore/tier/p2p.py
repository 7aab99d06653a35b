"""Messages between two ranks over a process group, each wait bounded by ``CKPTSTORE_PEER_TIMEOUT``.

A message is its length (one int64) and then its bytes, so that the receiver checks the length
before it allocates anything. Replication (``replicas``) and a restore's reads from peers
(``recover``) talk this way. A peer that stops answering (hung, or its node gone) makes the
wait fail after the timeout, a peer whose process died at once: either is a StorageError
naming the rank, never a hang.
"""

from __future__ import annotations

import warnings
from datetime import timedelta

from .. import remote_knobs
from ..errors import StorageError

# Node names travel padded to this many bytes (CKPTSTORE_NODE allows 255 characters; hostnames 253).
NAME_BYTES = 1024
# A length that says "no message": the sender has nothing to send (what it was asked for is gone).
NOTHING = -1


def post(data: bytes | None, to: int, group) -> list:
    """Start sending ``data`` (None: ``NOTHING``) to rank ``to``; the works to ``finish``."""
    import torch
    import torch.distributed as dist

    length = NOTHING if data is None else len(data)
    works = [dist.isend(torch.tensor([length], dtype=torch.int64), to, group=group)]
    if data:
        with warnings.catch_warnings():  # a read-only buffer: the send only reads it, no copy needed
            warnings.simplefilter("ignore", UserWarning)
            payload = torch.frombuffer(data, dtype=torch.uint8)
        works.append(dist.isend(payload, to, group=group))
    return works


def finish(works: list, peer: int | None) -> None:
    """Wait for ``works`` (sends or receives with rank ``peer``; None: a collective of every
    rank), each up to the timeout."""
    timeout = remote_knobs.peer_timeout()
    for work in works:
        try:
            work.wait(timeout=timedelta(seconds=timeout))
        except RuntimeError as exc:  # gloo: a timeout, or the peer's connection closed
            who = "a rank of the job" if peer is None else f"rank {peer}"
            raise StorageError(f"{who} did not answer within {timeout:g} s ({exc})") from None


def gather_names(name: str, group, size: int) -> list[str]:
    """Every rank's ``name`` (up to ``NAME_BYTES`` bytes of UTF-8), in rank order: an
    all-gather of ``size`` ranks bounded by the timeout, as the messages are."""
    import torch
    import torch.distributed as dist

    data = name.encode()
    if len(data) > NAME_BYTES:
        raise StorageError(f"{name[:40]!r}... is longer than {NAME_BYTES} bytes")
    mine = torch.frombuffer(bytearray(data.ljust(NAME_BYTES, b"\0")), dtype=torch.uint8)
    every = [torch.empty(NAME_BYTES, dtype=torch.uint8) for _ in range(size)]
    finish([dist.all_gather(every, mine, group=group, async_op=True)], None)
    return [bytes(t.numpy()).rstrip(b"\0").decode(errors="replace") for t in every]


def send(data: bytes | None, to: int, group) -> None:
    """Send ``data`` (None: ``NOTHING``) to rank ``to``; returns once it is sent."""
    finish(post(data, to, group), to)


def receive_length(source: int, group) -> int:
    """The length of the next message from rank ``source`` (``NOTHING``: none follows)."""
    import torch
    import torch.distributed as dist

    announced = torch.empty(1, dtype=torch.int64)
    finish([dist.irecv(announced, source, group=group)], source)
    return int(announced.item())


def receive_bytes(length: int, source: int, group) -> bytes:
    """The ``length`` bytes that follow a message's length from rank ``source``."""
    import torch
    import torch.distributed as dist

    payload = torch.empty(length, dtype=torch.uint8)
    if length:
        finish([dist.irecv(payload, source, group=group)], source)
    return payload.numpy().tobytes()
