"""Uploading behind training: one thread per process that drains the local tier as steps arrive.

The queue is the local tier itself (steps whose manifest it holds and that it has not marked
uploaded), so it survives a crash: the next open on that node, or ``ckptstore drain --local``,
picks up where a killed process stopped. The thread runs at a lower CPU priority than
training, never raises into it, and while the remote cannot be reached retries with growing
waits, saying so once on stderr; ``Tier.pending`` shows the backlog and each step's last error.
"""

from __future__ import annotations

import logging
import random
import threading

from .. import remote_knobs
from ..errors import CkptStoreError

log = logging.getLogger("ckptstore")


class BackgroundUploader:
    """A daemon thread that runs ``upload_pass`` whenever woken, polled, or retrying after a failure.

    ``upload_pass()`` uploads what is pending and returns the steps that failed (step -> error).
    """

    def __init__(self, upload_pass, describe: str) -> None:
        self._upload_pass = upload_pass
        self._describe = describe
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._failing = False
        self._thread = threading.Thread(target=self._run, name="ckptstore-upload", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        """Look for pending steps now (a commit just landed in the tier)."""
        self._wake.set()

    def stop(self) -> None:
        """Stop after the step being uploaded, if any; returns once the thread has ended."""
        self._stopping.set()
        self._wake.set()
        self._thread.join()

    def _run(self) -> None:
        from ..commit.background import lower_thread_priority

        lower_thread_priority()
        wait = remote_knobs.local_retry_first()
        while not self._stopping.is_set():
            try:
                failed = self._upload_pass()
            except CkptStoreError as exc:  # the tier itself could not be read: try again later
                failed = {-1: exc}
            except Exception as exc:  # never into training; say it, then go on trying
                log.exception("ckptstore: background upload failed")
                failed = {-1: exc}
            if failed:
                self._report(failed)
                pause = random.uniform(wait / 2, wait)
                wait = min(wait * 2, remote_knobs.local_retry_longest())
            else:
                if self._failing:
                    log.warning("ckptstore: uploads to %s go on again", self._describe)
                self._failing = False
                wait = remote_knobs.local_retry_first()
                pause = remote_knobs.local_poll_seconds()
            self._wake.wait(pause)
            self._wake.clear()

    def _report(self, failed: dict) -> None:
        """Say once per outage that uploads are failing, and why."""
        if self._failing:
            return
        self._failing = True
        steps = sorted(step for step in failed if step >= 0)
        first = failed[min(failed)]
        log.warning(
            "ckptstore: uploads to %s are failing (%s); steps %s wait in the local tier and are retried: %s",
            self._describe,
            type(first).__name__,
            ", ".join(map(str, steps)) or "-",
            first,
        )
