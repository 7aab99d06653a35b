"""PyTorch Distributed Checkpoint (DCP) jobs on CPU: FSDP2 and DTensor tensor parallelism, any storage.

Run under torch.distributed.run (gloo), from the repository root::

    python -m torch.distributed.run --nproc_per_node 2 --master_port PORT tests/dcp_jobs.py \\
        train-save --steps 3 --save fs:/tmp/ckpt --dump /tmp/saved.pt --result /tmp/r.json
    python -m torch.distributed.run --nproc_per_node 2 --master_port PORT tests/dcp_jobs.py \\
        resume --load fs:/tmp/ckpt --steps 2 --result /tmp/r.json
    python tests/dcp_jobs.py dump-full --load fs:/tmp/ckpt --out /tmp/full.pt   # 1 rank, no torchrun
    python tests/dcp_jobs.py tp-load-nodist --load fs:/tmp/tp --out /tmp/tp.pt  # no process group at all

Subcommands (every one but tp-load-nodist also runs as a plain ``python`` process: world size 1):

* ``train-save --steps N --save SPEC [--save-async] [--then M] [--dump FILE]``: FSDP2 Llama, N AdamW
  steps, DCP save, then M more steps (default 0; 2 with ``--save-async``, which trains them while the
  save is in flight and waits for it afterwards). ``--dump`` writes the full state right after the save
  is issued (what the checkpoint holds; async staging has already copied it by then).
* ``resume --load SPEC --steps K [--start-step S]``: a fresh model and optimizer (another init seed:
  the load must overwrite everything), DCP load, K more steps. S defaults to the AdamW step count
  read from the loaded optimizer state, so the resumed steps see the batches the uninterrupted job
  would have seen at those step numbers.
* ``dump-full --load SPEC --out FILE``: load, then gather the full (unsharded, CPU) state into FILE.
* ``tp-save --save SPEC --dump FILE``: a two-Linear MLP tensor-parallel over all ranks (colwise up,
  rowwise down), one AdamW step, DCP save; FILE gets the full tensors.
* ``tp-load-nodist --load SPEC --out FILE``: the same MLP, unparallelised, loaded with
  ``no_dist=True`` in a single process that never initialises torch.distributed.
* ``sequence FILE``: the subcommands FILE lists (a JSON list of argument lists, each with its own
  ``--result``) one after another in this one job: each interpreter start costs seconds.

Dump files (``torch.save``, read with ``weights_only=True``) hold ``{"model": {fqn: tensor},
"optim": {"state": {fqn: {"step", "exp_avg", "exp_avg_sq"}}, "param_groups": [...]}}``: the
``get_state_dict`` layout, fully gathered, so a dump from any world size compares key by key.

``--result PATH`` (optional, any subcommand): rank 0 writes JSON with ``world_size`` and, where the
job trains, ``losses`` (one per optimizer step it took, each the mean of the ranks' losses) and
``steps`` (their global step numbers, 0-based); train-save adds ``saved_after`` (the step count in
the checkpoint), resume and dump-full ``loaded_step`` (the AdamW step count they loaded).

Storage SPECs:

* ``fs:<dir>``: DCP's ``FileSystemWriter(dir)`` / ``FileSystemReader(dir)``.
* ``store:<store-uri>:<step>`` and, for saving, ``store:<store-uri>:<step>:<layer>,<layer>,...``:
  ``ckptstore.integrations.dcp.StoreWriter(store, step=step, layers=[...] or None)`` /
  ``StoreReader(store, step=step)`` with ``store = ckptstore.open(uri)`` on every rank. The SPEC is
  split from the right, so the URI may contain colons; for loading, the step may be ``latest``
  (``step=None``).

Determinism: every rank builds the model under the same seed; ``torch.use_deterministic_algorithms``
is on; attention is eager and dropout is off. Training data is per-rank (data parallel): the batch
of global step ``s`` on rank ``r`` comes from a generator seeded with ``(DATA_SEED, s, r)`` only, so it
does not depend on what ran before, and a job on W ranks sees the same data whenever it runs. Losses
therefore depend on the world size.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

# Run as a script, sys.path[0] is tests/: the repository root goes first so that ``import ckptstore``
# finds this checkout, not whichever one the virtualenv's editable install points at.
_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

# The tiny Llama (tools.engines.build_model): big enough for 4 FSDP units with real sharding, small
# enough for 2 shared cores.
VOCAB, HIDDEN, LAYERS = 256, 64, 4
SEQ, BATCH = 32, 2
LR = 1e-3
INIT_SEED = 0  # train-save; resume and dump-full build with RESUME_SEED and rely on the load
RESUME_SEED = 1
DATA_SEED = 1234
TP_IN, TP_HIDDEN = 16, 32


# --- storage -------------------------------------------------------------------------------------


def parse_store_spec(rest: str, saving: bool) -> tuple[str, int | None, list[str] | None]:
    """``<uri>:<step>[:<layers>]`` -> (uri, step, layers). Split from the right: URIs have colons."""
    uri, _, last = rest.rpartition(":")
    layers = None
    if saving and not last.isdigit() and ":" in uri:
        # A trailing part that is not a step number is the layer list.
        layers = [name for name in last.split(",") if name]
        uri, _, last = uri.rpartition(":")
    if last == "latest" and not saving:
        return uri, None, None
    if not uri or not last.isdigit():
        what = "<uri>:<step>[:<layer>,...]" if saving else "<uri>:<step>|latest"
        raise SystemExit(f"bad store spec {rest!r}: expected store:{what}")
    return uri, int(last), layers


def open_store(uri: str):
    import ckptstore

    # "{rank}" in CKPTSTORE_LOCAL gives each rank a local tier of its own: a node each.
    local = os.environ.get("CKPTSTORE_LOCAL", "").format(rank=os.environ.get("RANK", "0"))
    return ckptstore.open(uri, local=local)


def parse_storage_spec(spec: str, saving: bool) -> tuple[str, Any, int | None, list[str] | None]:
    """A storage SPEC -> ``(kind, where, step, layers)``: ``("fs", dir, None, None)`` or
    ``("store", opened store, step, layers)``. SystemExit for anything else."""
    kind, _, rest = spec.partition(":")
    if kind == "fs":
        return kind, rest, None, None
    if kind == "store":
        uri, step, layers = parse_store_spec(rest, saving)
        return kind, open_store(uri), step, layers
    raise SystemExit(f"bad storage spec {spec!r}: expected fs:<dir> or store:<uri>:<step>")


def storage_writer(spec: str):
    """The DCP StorageWriter a SPEC names (see the module docstring)."""
    import torch.distributed.checkpoint as dcp

    kind, where, step, layers = parse_storage_spec(spec, saving=True)
    if kind == "fs":
        return dcp.FileSystemWriter(where)
    from ckptstore.integrations.dcp import StoreWriter

    return StoreWriter(where, step=step, layers=layers or None)


def storage_reader(spec: str):
    """The DCP StorageReader a SPEC names (see the module docstring)."""
    import torch.distributed.checkpoint as dcp

    kind, where, step, _ = parse_storage_spec(spec, saving=False)
    if kind == "fs":
        return dcp.FileSystemReader(where)
    from ckptstore.integrations.dcp import StoreReader

    return StoreReader(where, step=step)


# --- process group -------------------------------------------------------------------------------


def init_distributed() -> int:
    """gloo process group (world size 1 when not launched by torchrun); returns the world size."""
    import torch.distributed as dist

    if dist.is_initialized():  # the commands of a ``sequence`` share one process group
        return dist.get_world_size()
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo")
    return dist.get_world_size()


def mean_over_ranks(value: torch.Tensor) -> float:
    import torch.distributed as dist

    total = value.detach().clone()
    dist.all_reduce(total)  # SUM: gloo has no AVG, and a sum of W floats is order-independent for W=2
    return float(total) / dist.get_world_size()


def write_result(path: str | None, result: dict[str, Any]) -> None:
    import torch.distributed as dist

    if path and (not dist.is_initialized() or dist.get_rank() == 0):
        Path(path).write_text(json.dumps(result, indent=1))


# --- FSDP2 Llama ---------------------------------------------------------------------------------


def build_fsdp(seed: int):
    """The tiny Llama, every decoder block and then the root ``fully_shard``-ed over all ranks, and
    its AdamW (created after sharding, so it holds the DTensor parameters)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from tools.engines import build_model

    model = build_model("llama", seed=seed, num_layers=LAYERS, hidden=HIDDEN, vocab=VOCAB, max_positions=SEQ)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    return model, optim


def batch(step: int, rank: int) -> torch.Tensor:
    """Input ids of global step ``step`` on rank ``rank``: a function of (step, rank) alone."""
    g = torch.Generator().manual_seed(DATA_SEED + 100_003 * step + rank)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def train(model, optim, steps: range) -> list[float]:
    import torch.distributed as dist

    losses = []
    for step in steps:
        ids = batch(step, dist.get_rank())
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        losses.append(mean_over_ranks(loss))
    return losses


def sharded_state(model, optim) -> dict[str, Any]:
    """``{"model", "optim"}`` as DCP saves and loads it: DTensor shards keyed by FQN.

    On a fresh optimizer ``get_state_dict`` first creates AdamW's lazily built state itself
    (``_init_optim_state``: one ``step()`` with zero gradients and lr 0, which leaves the parameters
    bit-identical); without that state DCP would have nothing to load the moments into.
    """
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optim)
    return {"model": model_sd, "optim": optim_sd}


def load_into(model, optim, spec: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = sharded_state(model, optim)
    dcp.load(state, storage_reader=storage_reader(spec))
    # dcp.load fills the tensors in place but replaces non-tensor values (param_groups' lr, betas,
    # ...) in ``state``: set_state_dict puts those back into the optimizer.
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])


def dump_full(model, optim, out: str) -> None:
    """Gather the full state (a collective) and have rank 0 ``torch.save`` it to ``out``."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd, optim_sd = get_state_dict(model, optim, options=options)
    if dist.get_rank() == 0:
        torch.save({"model": model_sd, "optim": optim_sd}, out)


def adam_step_count(optim) -> int:
    """How many steps the (loaded) AdamW state has taken: the most any parameter has (a
    composite store step gives each layer the optimizer state of the step it comes from)."""
    counts = {int(s["step"]) for s in optim.state.values()}
    if not counts:
        raise RuntimeError("the optimizer holds no state")
    return max(counts)


def cmd_train_save(args) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    init_distributed()
    model, optim = build_fsdp(INIT_SEED)
    losses = train(model, optim, range(args.steps))
    state = sharded_state(model, optim)
    writer = storage_writer(args.save)
    then = args.then if args.then is not None else (2 if args.save_async else 0)
    if args.save_async:
        # A group of its own: the save's collectives run on a background thread while training
        # keeps using the default group.
        future = dcp.async_save(state, storage_writer=writer, process_group=dist.new_group(backend="gloo"))
    else:
        dcp.save(state, storage_writer=writer)
    if args.dump:
        dump_full(model, optim, args.dump)  # async_save returns after staging: still what is saved
    losses += train(model, optim, range(args.steps, args.steps + then))
    if args.save_async:
        # Newer stagers answer an AsyncSaveResponse; FileSystemWriter's blocking stager a Future.
        getattr(future, "upload_completion", future).result()
    return {"losses": losses, "steps": list(range(args.steps + then)), "saved_after": args.steps}


def cmd_resume(args) -> dict[str, Any]:
    init_distributed()
    model, optim = build_fsdp(RESUME_SEED)
    load_into(model, optim, args.load)
    loaded = adam_step_count(optim)
    start = loaded if args.start_step is None else args.start_step
    steps = range(start, start + args.steps)
    return {"losses": train(model, optim, steps), "steps": list(steps), "loaded_step": loaded}


def cmd_dump_full(args) -> dict[str, Any]:
    init_distributed()
    model, optim = build_fsdp(RESUME_SEED)
    load_into(model, optim, args.load)
    dump_full(model, optim, args.out)
    return {"loaded_step": adam_step_count(optim)}


# --- tensor parallelism --------------------------------------------------------------------------


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(TP_IN, TP_HIDDEN)
        self.down = nn.Linear(TP_HIDDEN, TP_IN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def build_mlp(seed: int) -> tuple[MLP, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    mlp = MLP()
    return mlp, torch.optim.AdamW(mlp.parameters(), lr=LR)


def full_tensors(obj: Any) -> Any:
    """``obj`` with every DTensor replaced by its gathered ``full_tensor()`` (a collective)."""
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        return obj.full_tensor()
    if isinstance(obj, dict):
        return {k: full_tensors(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [full_tensors(v) for v in obj]
    return obj


def cmd_tp_save(args) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    world = init_distributed()
    mlp, _ = build_mlp(INIT_SEED)
    mesh = init_device_mesh("cpu", (world,))
    parallelize_module(mlp, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    optim = torch.optim.AdamW(mlp.parameters(), lr=LR)  # after parallelising: DTensor parameters
    # Tensor parallelism needs the same input on every rank.
    g = torch.Generator().manual_seed(DATA_SEED)
    x, target = torch.randn(8, TP_IN, generator=g), torch.randn(8, TP_IN, generator=g)
    loss = (mlp(x) - target).pow(2).mean()
    loss.backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    state = sharded_state(mlp, optim)
    dcp.save(state, storage_writer=storage_writer(args.save))
    full = full_tensors(state)
    if dist.get_rank() == 0:
        torch.save(full, args.dump)
    return {"losses": [loss.item()], "steps": [0]}


def cmd_tp_load_nodist(args) -> dict[str, Any]:
    """No process group: DCP's ``no_dist=True`` load into the plain (unparallelised) MLP."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    mlp, optim = build_mlp(RESUME_SEED)
    state = sharded_state(mlp, optim)
    dcp.load(state, storage_reader=storage_reader(args.load), no_dist=True)
    set_state_dict(mlp, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    torch.save(sharded_state(mlp, optim), args.out)
    return {}


# --- command line --------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    def command(name: str, run, **spec_args: str) -> argparse.ArgumentParser:
        c = sub.add_parser(name)
        c.set_defaults(run=run)
        for flag, help_text in spec_args.items():
            c.add_argument(f"--{flag}", required=True, help=help_text)
        c.add_argument("--result", help="JSON result file, written by rank 0")
        return c

    c = command("train-save", cmd_train_save, save="storage SPEC to save to")
    c.add_argument("--steps", type=int, required=True, help="optimizer steps before the save")
    c.add_argument("--save-async", action="store_true", help="dcp.async_save, training on meanwhile")
    c.add_argument("--then", type=int, help="steps after the save (default 0, 2 with --save-async)")
    c.add_argument("--dump", help="torch.save the full state just saved to this file")
    c = command("resume", cmd_resume, load="storage SPEC to load from")
    c.add_argument("--steps", type=int, required=True, help="optimizer steps after the load")
    c.add_argument("--start-step", type=int, help="global step of the first one (default: as loaded)")
    command("dump-full", cmd_dump_full, load="storage SPEC to load from", out="torch.save file to write")
    command("tp-save", cmd_tp_save, save="storage SPEC to save to", dump="full tensors, torch.save file")
    command("tp-load-nodist", cmd_tp_load_nodist, load="storage SPEC to load from", out="torch.save file")
    return p


def main(argv: list[str] | None = None, sequence: bool = False) -> None:
    import torch.distributed as dist

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["sequence"]:
        for each in json.loads(Path(argv[1]).read_text()):
            main(each, sequence=True)
        if dist.is_initialized():
            dist.destroy_process_group()
        return
    args = parser().parse_args(argv)
    torch.use_deterministic_algorithms(True)  # raises on a nondeterministic op rather than drift
    result = args.run(args)
    if dist.is_initialized():
        result["world_size"] = dist.get_world_size()
        write_result(args.result, result)
        dist.barrier()  # nobody exits (tearing down gloo) while another rank still needs it
        if not sequence:
            dist.destroy_process_group()
    else:
        write_result(args.result, result | {"world_size": 1})


if __name__ == "__main__":
    main()
