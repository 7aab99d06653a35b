"""retry(): what the S3 backend relies on when it retries past botocore."""

from __future__ import annotations

import pytest

from ckptstore.objects.retry import BASE_DELAY, retry


class Transient(Exception):
    pass


class Permanent(Exception):
    pass


def failing(times: int, exc_type: type[Exception] = Transient):
    """A callable that raises ``exc_type`` on its first ``times`` calls, then returns "ok"."""
    calls = []

    def fn() -> str:
        calls.append(len(calls))
        if len(calls) <= times:
            raise exc_type(f"failure {len(calls)}")
        return "ok"

    fn.calls = calls
    return fn


def transient(exc: Exception) -> bool:
    return isinstance(exc, Transient)


def test_a_transient_failure_is_retried_until_the_call_succeeds():
    fn, slept = failing(2), []
    assert retry(fn, attempts=5, should_retry=transient, sleep=slept.append) == "ok"
    assert len(fn.calls) == 3
    assert len(slept) == 2  # one wait between each two attempts


def test_gives_up_after_the_given_attempts_and_raises_the_last_error():
    fn, slept = failing(10), []
    with pytest.raises(Transient, match="failure 4"):
        retry(fn, attempts=4, should_retry=transient, sleep=slept.append)
    assert len(fn.calls) == 4
    assert len(slept) == 3  # no wait after the last attempt


def test_a_permanent_error_is_raised_at_once():
    fn, slept = failing(1, Permanent), []
    with pytest.raises(Permanent, match="failure 1"):
        retry(fn, attempts=5, should_retry=transient, sleep=slept.append)
    assert len(fn.calls) == 1
    assert slept == []


def test_waits_are_jittered_within_a_doubling_bound():
    slept = []
    with pytest.raises(Transient):
        retry(failing(10), attempts=5, should_retry=transient, sleep=slept.append)
    assert len(slept) == 4
    for n, delay in enumerate(slept):
        assert 0 <= delay <= BASE_DELAY * 2**n


def test_one_attempt_means_no_retry():
    fn = failing(1)
    with pytest.raises(Transient):
        retry(fn, attempts=1, should_retry=transient, sleep=lambda _: pytest.fail("slept"))
    assert len(fn.calls) == 1


def test_fewer_than_one_attempt_is_refused():
    with pytest.raises(ValueError):
        retry(lambda: "ok", attempts=0, should_retry=transient)
