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
from pathlib import Path

import ckptstore
import ckptstore.cli
import ckptstore.export.folder
import ckptstore.materialize.directory
import ckptstore.verify
from ckptstore.errors import CkptStoreError
from ckptstore.tier.recover import intact, recorded_raw_sizes
from tools import engines


def peak_kb() -> int:
    """This process's peak resident memory so far, in KiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def read(store: str, command: list[str], env: dict[str, str]) -> dict:
    """Run ``command`` (CLI arguments, ``["restore", engine options JSON, step]``, or
    ``["intact", object name, file, step]``: recovery's check of the file's bytes received from a
    peer as that object of that step) on ``store`` with the environment ``env``: ``{"rc",
    "grown_kb", "out"}``, ``grown_kb`` the growth of the peak resident memory over the read
    alone (imports, the engine and the bytes received before it)."""
    os.environ.clear()
    os.environ.update(env)
    if command[0] == "intact":
        return check_received(store, command[1], Path(command[2]).read_bytes(), int(command[3]))
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


def check_received(store: str, name: str, data: bytes, step: int) -> dict:
    """``read`` of recovery's check (``tier.recover.intact``) of ``data`` received as ``name``,
    bounded by the sizes ``store``'s catalog records for ``step``: rc 0 if it passed, else 4."""
    opened = ckptstore.open(store, create=False)
    sizes = recorded_raw_sizes(opened.catalog, [step], [name])
    before = peak_kb()
    problem = intact(name, name, data, opened.objects, sizes.get(name))
    grown = peak_kb() - before
    opened.close()
    return {"rc": 0 if problem is None else 4, "grown_kb": grown, "out": str(problem)}
