"""Retrying a failure that botocore's own retry loop cannot see or does not retry.

botocore retries a request; it does not retry reading a response body that broke off after
the request returned, nor a 409 ConditionalRequestConflict on a create-only write. The S3
backend retries those itself, with the same bounded, jittered exponential backoff.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

# First retry waits at most 50 ms, doubling each time: with the default 5 attempts the
# waits add up to at most 0.75 s, short next to the request being retried.
BASE_DELAY = 0.05


def retry(
    fn: Callable[[], T],
    *,
    attempts: int,
    should_retry: Callable[[Exception], bool],
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """Call ``fn`` until it returns, at most ``attempts`` times (first call included).

    An exception for which ``should_retry`` is true is retried after sleeping a random time in
    ``[0, BASE_DELAY * 2**n]`` (``n`` = 0 before the second call, 1 before the third, ...). Any
    other exception, and the retryable one from the last attempt, propagates unchanged (same
    object, same traceback). Returns what ``fn`` returned. ``attempts`` must be at least 1.
    """
    if attempts < 1:
        raise ValueError(f"attempts must be at least 1, not {attempts}")
    for attempt in range(attempts):
        try:
            return fn()
        except Exception as exc:
            if attempt + 1 == attempts or not should_retry(exc):
                raise
        # Full jitter: writers that collided on one key should not collide again in step.
        sleep(random.uniform(0, BASE_DELAY * 2**attempt))
    raise AssertionError("unreachable")
