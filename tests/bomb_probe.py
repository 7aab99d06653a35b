"""One read of a bombed store, measured, in a process of its own (run by tests/test_bombs.py).

Each read runs in a fresh child forked from a warm server process that imported this module
(``multiprocessing``'s forkserver with this module preloaded), so a read costs a fork rather
than an interpreter start and the imports of torch and DeepSpeed.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import resource

import ckptstore
import ckptstore.cli
import ckptstore.export.folder
import ckptstore.materialize.directory
import ckptstore.verify
from ckptstore.errors import CkptStoreError
from tools import engines


def peak_kb() -> int:
    """This process's peak resident memory so far, in KiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def read(store: str, command: list[str], env: dict[str, str]) -> dict:
    """Run ``command`` (CLI arguments, or ``["restore", engine options JSON, step]``) on
    ``store`` with the environment ``env``: ``{"rc", "grown_kb", "out"}``, ``grown_kb`` the
    growth of the peak resident memory over the read alone (imports and the engine before it)."""
    os.environ.clear()
    os.environ.update(env)
    engine = engines.build_engine(**json.loads(command[1])) if command[0] == "restore" else None
    before = peak_kb()
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            if engine is not None:
                ckptstore.open(store, create=False).restore(engine, int(command[2]))
            else:
                ckptstore.cli.main(["--store", store, *command])
            rc = 0
        except CkptStoreError as exc:
            print(type(exc).__name__, exc)
            rc = exc.exit_code
        except SystemExit as exc:
            rc = exc.code or 0
    return {"rc": rc, "grown_kb": peak_kb() - before, "out": out.getvalue()[-2000:]}
