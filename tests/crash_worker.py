"""Processes that commit or collect garbage and die on purpose, for tests/test_gc.py.

    python tests/crash_worker.py MODE STORE [ARGS...]

Modes:
  die-at STAGE          commit step 1, then die (os._exit) at STAGE of committing step 2:
                        blob (after some blobs), manifest (before the catalog row), catalog (inside it)
  commit-loop [--wait]  commit steps 1, 2, 3, ... forever (print "ready" after the first); killed by the test.
                        --wait: build the engine, then open the store only once a line comes on stdin
                        (a process started ahead, while the test still works on the store)
  commit-n N DUMPS      commit N steps (every third one partial), saving each step's state to DUMPS/<step>.pt
  commit-async-exit     start a non-blocking commit of step 1 and exit normally right away
  gc-loop SECONDS [UNTIL]  run gc(keep_last=3, grace=0) over and over for SECONDS, or until the
                        file UNTIL exists (what a commit-n writes last), whichever comes first
  gc-die-after N        gc(keep_last=1, grace=0), dying after N blob deletions
  race SEED DUMPS       build an engine from SEED (print "ready"), then for each step read on stdin:
                        train a batch, commit it, print "won STEP" (saving the state to
                        DUMPS/<seed>-<step>.pt) or "lost STEP <error class>"
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.engines import batches, build_engine, setup_single_process_env, train  # noqa: E402

LAYERS = [f"model.layers.{i}" for i in range(3)]


def engine():
    return build_engine("llama", zero_stage=2, dtype="bf16", seed=0, num_layers=3)


def state_values(eng) -> dict:
    from ckptstore.deepspeed.extract import extract

    return {(p.name, p.kind): p.tensor.clone() for p in extract(eng).pieces}


def die_at(store, stage: str) -> None:
    eng = engine()
    train(eng, batches(1))
    store.commit(eng, step=1)
    train(eng, batches(2)[1:])
    if stage == "blob":  # some packs of step 2 are written, then the process dies
        put, calls = store.objects.put_if_absent, []

        def dying_put(name, data):
            calls.append(name)
            if len(calls) > 3:
                os._exit(9)
            return put(name, data)

        store.objects.put_if_absent = dying_put
    elif stage == "manifest":  # the manifest is written, the catalog row never is
        store.catalog.record_step = lambda *record, **rows: os._exit(9)
    elif stage == "catalog":  # dies inside the catalog transaction, after the steps row
        from sqlite_utils.db import Table

        insert_all = Table.insert_all

        def dying_insert_all(self, *args, **kwargs):
            if self.name == "tensors":
                os._exit(9)
            return insert_all(self, *args, **kwargs)

        Table.insert_all = dying_insert_all
    store.commit(eng, step=2)


def commit_loop(open_store, wait: bool = False) -> None:
    eng = engine()
    if wait:
        sys.stdin.readline()
    store = open_store()
    data = batches(1000)
    step = 0
    while True:
        step += 1
        train(eng, data[step : step + 1])
        store.commit(eng, step=step, layers=None if step % 2 else LAYERS[step % 3 :: 2])
        if step == 1:
            print("ready", flush=True)


def commit_n(store, n: int, dumps: Path) -> None:
    import torch

    eng = engine()
    data = batches(n + 1)
    for step in range(1, n + 1):
        train(eng, data[step : step + 1])
        store.commit(eng, step=step, layers=LAYERS[step % 2 :: 2] if step % 3 == 0 else None)
        torch.save(state_values(eng), dumps / f"{step}.pt")


def commit_async_and_exit(store) -> None:
    """Start a non-blocking commit and end the script at once: exit must flush it."""
    eng = engine()
    train(eng, batches(1))
    store.commit(eng, step=1, blocking=False)
    sys.exit(0)  # a normal exit, so atexit handlers run


def gc_loop(store, seconds: float, until: Path | None = None) -> None:
    end = time.time() + seconds
    runs = 0
    while time.time() < end and not (until and until.exists()):
        store.gc(keep_last=3, grace=0)
        runs += 1
    print(f"gc runs: {runs}", flush=True)


def gc_die_after(store, n: int) -> None:
    calls = {"n": 0}
    delete = store.objects.delete

    def dying_delete(name):
        if name.startswith("packs/"):
            calls["n"] += 1
            if calls["n"] > n:
                os._exit(9)
        return delete(name)

    store.objects.delete = dying_delete
    store.gc(keep_last=1, grace=0)


def race(store, seed: int, dumps: Path) -> None:
    import torch

    from ckptstore.errors import ConflictError

    eng = build_engine("llama", zero_stage=2, dtype="bf16", seed=seed, num_layers=3)
    data = batches(64)
    print("ready", flush=True)
    for line in sys.stdin:
        step = int(line)
        train(eng, data[step % 64 : step % 64 + 1])
        try:
            store.commit(eng, step=step)
        except ConflictError:
            print(f"lost {step} ConflictError", flush=True)
            continue
        torch.save(state_values(eng), dumps / f"{seed}-{step}.pt")
        print(f"won {step}", flush=True)


def main() -> None:
    setup_single_process_env()
    import logging

    from deepspeed.utils import logger

    import ckptstore

    logger.setLevel(logging.ERROR)
    mode, args = sys.argv[1], sys.argv[3:]
    if mode == "commit-loop":  # opens the store itself, once its engine is built
        commit_loop(lambda: ckptstore.open(sys.argv[2]), wait="--wait" in args)
    store = ckptstore.open(sys.argv[2])
    if mode == "die-at":
        die_at(store, args[0])
    elif mode == "commit-n":
        commit_n(store, int(args[0]), Path(args[1]))
    elif mode == "commit-async-exit":
        commit_async_and_exit(store)
    elif mode == "gc-loop":
        gc_loop(store, float(args[0]), Path(args[1]) if len(args) > 1 else None)
    elif mode == "gc-die-after":
        gc_die_after(store, int(args[0]))
    elif mode == "race":
        race(store, int(args[0]), Path(args[1]))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
