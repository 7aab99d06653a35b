"""Benchmark the blob codec against blosc2 (shuffle + zstd), per core, on the bench tensors.

    python tools/bench_codec.py [--hidden 768 --layers 8 --vocab 16000 --reps 9]
                                [--steps 3] [--level 1] [--baseline REV] [--cpu N] [--tensors FILE]

Builds the bench model (a Llama of about 80M parameters, bf16, ZeRO-2, one rank, CPU), trains
it ``--steps`` steps, and takes its largest bf16 module weight (``lm_head.weight``, 16000 x 768:
``embed_tokens`` is as large, but the rows of tokens the batches never hold barely move) and the
fp32 master copy of the same weight. On one core (the process pinned to it, torch and blosc2 on
one thread), taking turns rep by rep, it times for each tensor:
- ckptstore: ``codec.encode`` (hashing the content key included) and ``codec.decode_into`` a
  preallocated tensor (re-hashing and comparing the key included; the hash alone is reported
  as a share of the decode);
- blosc2: ``compress2`` (zstd at ``--level``, byte shuffle, nthreads=1) and ``decompress2`` into a
  preallocated buffer; level 1 is blosc2's closest ratio to ours on these tensors (its higher
  levels were larger here);
- with ``--baseline REV``: ckptstore's codec as it was at git revision REV, for before/after.
Reported: medians of the reps in MB/s of uncompressed bytes, compressed size / raw size, and
ours over blosc2. Absolute speeds on a shared box are noise; the ratios, side by side, are the
result. blosc2 is a peer to measure against, not a dependency: ``pip install -e ".[dev]"`` or
``pip install blosc2``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools.engines import (  # noqa: E402
    add_bench_model_options,
    batches,
    build_bench_engine,
    setup_single_process_env,
    train,
)


def bench_tensors(args) -> dict[str, torch.Tensor]:
    """The bench model's largest bf16 weight after ``args.steps`` steps, and its fp32 master."""
    import logging

    setup_single_process_env()
    from deepspeed.utils import logger as ds_logger
    from deepspeed.utils import safe_get_full_fp32_param

    ds_logger.setLevel(logging.WARNING)
    engine = build_bench_engine(args)
    train(engine, batches(args.steps, vocab=args.vocab))
    weight = engine.module.lm_head.weight
    return {
        f"bf16 lm_head.weight {tuple(weight.shape)}": weight.detach().clone(),
        f"fp32 master of it {tuple(weight.shape)}": safe_get_full_fp32_param(weight).detach().clone(),
    }


def codec_at(rev: str):
    """ckptstore's ``format/codec.py`` as it was at git revision ``rev``, importable beside today's."""
    source = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{rev}:ckptstore/format/codec.py"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    path = Path(tempfile.mkdtemp(prefix="ckptstore-codec-")) / "codec.py"
    path.write_text(source)
    name = "ckptstore.format._codec_baseline"  # a sibling of codec.py: its relative imports resolve
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def contenders(tensor: torch.Tensor, codecs: dict, level: int) -> dict[str, tuple]:
    """``name: (encode, decode, compressed size)`` for each codec and blosc2 on ``tensor``."""
    import blosc2

    from ckptstore.format import codec

    raw = codec.raw_bytes(tensor)
    out: dict[str, tuple] = {}
    for name, module in codecs.items():
        key, blob = module.encode(tensor)
        target = torch.empty_like(tensor)
        out[name] = (
            lambda module=module: module.encode(tensor),
            lambda module=module, blob=blob, key=key, target=target: module.decode_into(blob, key, target),
            len(blob),
        )
        module.decode_into(blob, key, target)
        assert torch.equal(target.view(torch.uint8), tensor.view(torch.uint8)), name
    cparams = blosc2.CParams(
        codec=blosc2.Codec.ZSTD,
        clevel=level,
        typesize=tensor.element_size(),
        filters=[blosc2.Filter.SHUFFLE],
        nthreads=1,
    )
    packed = blosc2.compress2(raw, cparams=cparams)
    dst = np.empty_like(raw)
    out[f"blosc2 zstd {level}"] = (
        lambda: blosc2.compress2(raw, cparams=cparams),
        lambda: blosc2.decompress2(packed, dst=dst),
        len(packed),
    )
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark with ``argv`` (default: the command line's); the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_bench_model_options(parser, hidden=768, layers=8, vocab=16000, reps=9)
    parser.add_argument("--steps", type=int, default=3, help="training steps before the tensors are taken")
    parser.add_argument("--level", type=int, default=1, help="blosc2's zstd level (default 1)")
    parser.add_argument(
        "--baseline", metavar="REV", help="also time the codec as it was at this git revision"
    )
    parser.add_argument("--cpu", type=int, help="the core to run on (default: the first allowed)")
    parser.add_argument("--tensors", type=Path, help="keep the bench tensors in this file and reuse them")
    args = parser.parse_args(argv)
    try:
        import blosc2
    except ImportError:
        sys.exit('blosc2 is the peer this compares with: pip install -e ".[dev]" (or pip install blosc2)')

    from ckptstore.format import codec

    codecs = {"ckptstore": codec}
    if args.baseline:
        codecs = {f"ckptstore@{args.baseline}": codec_at(args.baseline), **codecs}
    if args.tensors and args.tensors.exists():
        tensors = torch.load(args.tensors)
    else:
        tensors = bench_tensors(args)
        if args.tensors:
            torch.save(tensors, args.tensors)
    cpu = min(os.sched_getaffinity(0)) if args.cpu is None else args.cpu
    os.sched_setaffinity(0, {cpu})
    torch.set_num_threads(1)
    blosc2.set_nthreads(1)
    print(f"one core (cpu {cpu}), torch and blosc2 on one thread; medians of {args.reps} reps, MB/s")
    for label, tensor in tensors.items():
        runs = contenders(tensor, codecs, args.level)
        size = tensor.numel() * tensor.element_size()
        times: dict[tuple[str, str], list[float]] = {}
        for _ in range(args.reps):
            for name, (encode, decode, _) in runs.items():
                times.setdefault((name, "decode"), []).append(timed(decode))
                times.setdefault((name, "encode"), []).append(timed(encode))
            times.setdefault(("hash", "decode"), []).append(
                timed(lambda tensor=tensor: codec.tensor_key(tensor))
            )
        speed = {k: size / 1e6 / statistics.median(v) for k, v in times.items()}
        peer = f"blosc2 zstd {args.level}"
        print(f"\n{label}: {size / 1e6:.1f} MB")
        print(f"  {'':24s} {'decode':>8s} {'encode':>8s} {'ratio':>7s}")
        for name, (_, _, packed) in runs.items():
            print(
                f"  {name:24s} {speed[name, 'decode']:8.0f} {speed[name, 'encode']:8.0f} {packed / size:7.4f}"
            )
        ours, theirs = runs["ckptstore"][2], runs[peer][2]
        print(
            f"  ckptstore / blosc2: decode {speed['ckptstore', 'decode'] / speed[peer, 'decode']:.2f}x, "
            f"encode {speed['ckptstore', 'encode'] / speed[peer, 'encode']:.2f}x, bytes {ours / theirs:.3f}x; "
            f"the key's hash is {speed['ckptstore', 'decode'] / speed['hash', 'decode']:.0%} of ckptstore's decode"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
