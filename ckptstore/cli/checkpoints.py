"""``materialize`` and ``export``: checkpoints and model folders built from a step."""

from __future__ import annotations

import click

from ..export.folder import DEFAULT_MAX_SHARD_SIZE
from .base import cli, human, open_store


def step_or_spec_options(step_help: str):
    """``--step`` and ``--spec`` (exactly one of them, ``check_step_or_spec``), as a decorator."""

    def decorate(command):
        command = click.option(
            "--spec", type=click.Path(dir_okay=False), default=None,
            help="Instead of --step: a compose spec (YAML) naming the step of each layer range.",
        )(command)  # fmt: skip
        return click.option("--step", type=int, default=None, help=step_help)(command)

    return decorate


def check_step_or_spec(step: int | None, spec: str | None) -> None:
    """UsageError unless exactly one of ``--step`` and ``--spec`` was given."""
    if step is None and spec is None:
        raise click.UsageError("Missing option '--step' (or --spec)")
    if step is not None and spec is not None:
        raise click.UsageError("--step and --spec exclude each other")


@cli.command()
@step_or_spec_options("The committed step to rebuild.")
@click.option(
    "--world-size", type=click.IntRange(min=1), default=None,
    help="Data-parallel size of the job that will load it (default: the committing job's).",
)  # fmt: skip
@click.option(
    "--ep-size", type=click.IntRange(min=1), default=None,
    help="Expert-parallel size of the job that will load it, for a step with DeepSpeed MoE layers "
    "(default: the committing job's); it must divide --world-size and each layer's experts.",
)  # fmt: skip
@click.option(
    "--force", is_flag=True, help="Replace OUT if materialize or export wrote it (never another folder)."
)
@click.option(
    "--tag", default=None,
    help="Name of the checkpoint folder in OUT, and what `latest` says (default global_step<STEP>; "
    "accelerate's save_state uses pytorch_model).",
)  # fmt: skip
@click.option(
    "--allow-pickle", is_flag=True,
    help="Also write auxiliary files and DCP bytes items kept as the bytes they held (not plain "
    "data) that an unpickler could read: loaders of OUT (accelerate's load_state, DCP) would run any "
    "code in them. Only for a store no one untrusted can write; without it such a file is left out "
    "with a warning, such a bytes item refused (exit 4).",
)  # fmt: skip
@click.option(
    "--universal", is_flag=True,
    help="Write what DeepSpeed's ds_to_universal writes for the step instead (OUT/latest_universal, "
    "OUT/global_step<STEP>_universal/), for load_checkpoint with load_universal at another layout.",
)  # fmt: skip
@click.argument("out", type=click.Path(file_okay=False))
@click.pass_context
def materialize(
    ctx: click.Context,
    step: int | None,
    spec: str | None,
    world_size: int | None,
    ep_size: int | None,
    force: bool,
    tag: str | None,
    allow_pickle: bool,
    universal: bool,
    out: str,
) -> None:
    """Write step STEP (or the checkpoint a compose spec describes) as a DeepSpeed directory OUT.

    OUT gets ``latest``, ``global_step<STEP>/`` (or ``--tag``'s name) and the step's auxiliary
    files; resume with ``engine.load_checkpoint(OUT)``. OUT appears only once complete.
    A step saved through PyTorch DCP (StoreWriter) becomes a standard DCP directory instead,
    which dcp.load with FileSystemReader(OUT) reads at any world size. Every pickle or torch
    file written is one ckptstore serializes from the plain data kept at commit; a file kept
    as bytes that an unpickler could read is left out with a warning (a DCP bytes item so kept
    is refused, exit 4) unless --allow-pickle.

    A spec (YAML) says which step each block range and auxiliary layer comes from, and
    which step gives the non-tensor state and files:

    \b
        state: 400
        slices:
          - {layer_range: [0, 16], step: 300}
          - {layer_range: [16, 32], step: 400}
        aux: {model.embed_tokens: 300}

    \b
    Example: ckptstore --store runs/store materialize --step 300 out/
    For accelerate's load_state: ckptstore materialize --step 300 --tag pytorch_model out/
    DeepSpeed's universal checkpoint: ckptstore materialize --universal --step 300 out/
    A MoE step for 2 ranks without expert parallelism: ckptstore materialize --step 300 --world-size 2 --ep-size 1 out/
    """
    check_step_or_spec(step, spec)
    with open_store(ctx) as store:
        path = store.materialize(
            step, out, spec=spec, world_size=world_size, force=force, tag=tag, allow_pickle=allow_pickle,
            universal=universal, ep_size=ep_size,
        )  # fmt: skip
    click.echo(f"materialized {f'step {step}' if spec is None else spec} at {path}")


@cli.command()
@step_or_spec_options("The committed step whose weights to export.")
@click.option(
    "--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default=None,
    help="dtype of the weights written (default: the dtype the model trained in).",
)  # fmt: skip
@click.option(
    "--max-shard-size", default=DEFAULT_MAX_SHARD_SIZE, show_default=True,
    help="Split the weights into files of at most this size (e.g. 2GB, 500MB), as save_pretrained does.",
)  # fmt: skip
@click.option(
    "--force", is_flag=True, help="Replace OUT if materialize or export wrote it (never another folder)."
)
@click.argument("out", type=click.Path(file_okay=False))
@click.pass_context
def export(ctx, step, spec, dtype, max_shard_size, force, out) -> None:
    """Write the model weights of step STEP as a Hugging Face model folder OUT.

    OUT gets model.safetensors (or shards and model.safetensors.index.json past
    --max-shard-size) and the model-folder files kept with the step (config.json,
    generation_config.json, tokenizer files): AutoModelForCausalLM.from_pretrained(OUT)
    loads it. The weights are the step's fp32 masters, cast to --dtype; no DeepSpeed
    directory is written and memory stays a few tensors. OUT appears only once complete.

    \b
    Example: ckptstore --store runs/store export --step 400 out/llama-400/
             ckptstore export --step 400 --dtype float32 --max-shard-size 2GB out/
    """
    check_step_or_spec(step, spec)
    with open_store(ctx) as store:
        report = store.export(step, out, spec=spec, dtype=dtype, max_shard_size=max_shard_size, force=force)
    files = len(report.weight_files) + (1 if len(report.weight_files) > 1 else 0) + len(report.copied_files)
    click.echo(
        f"exported step {report.step} ({report.tensors} tensors, {report.dtype}, {human(report.bytes)}) "
        f"to {report.path}: {files} file(s)"
    )
    if not report.has_config:
        click.echo(
            f"warning: no config.json was kept with step {report.step}; copy the model's config.json "
            "into the folder before from_pretrained (commit with files=... to keep it)",
            err=True,
        )
