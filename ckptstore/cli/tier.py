"""``drain``: upload what a node's local tier holds and the store lacks (after a crash, or at the end of a job)."""

from __future__ import annotations

import json

import click
from tqdm import tqdm

from .. import opening
from ..progress import shown
from .base import cli, human, key_of


@cli.command()
@click.option(
    "--timeout",
    type=float,
    default=None,
    metavar="SECONDS",
    help="Keep trying this long while the store cannot be reached (default: try once; at most a week).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object per uploaded step.")
@click.pass_context
def drain(ctx: click.Context, timeout: float | None, as_json: bool) -> None:
    """Upload every step the local tier (--local DIR or $CKPTSTORE_LOCAL) holds and its store
    lacks, oldest first, then keep only what the tier's newest steps need (CKPTSTORE_LOCAL_KEEP).

    The tier knows its store: no --store is needed. Run it on the node whose tier it is, after
    a job was killed before its uploads finished; a step whose upload broke off is finished,
    never published half. Exit 7 naming the steps not uploaded when the store cannot be reached
    (they stay in the tier: run it again), 5 when the store has another commit of a step.

    \b
    Example: ckptstore drain --local /nvme/ckpt/run7
    """  # fmt: skip
    path = ctx.obj.get("local")
    if not path:
        raise click.UsageError("drain needs the local tier: pass --local DIR or set CKPTSTORE_LOCAL")
    with opening.open_local_tier(path, key=key_of(ctx)) as store:
        total = sum(step.bytes for step in store.pending())
        with tqdm(
            total=total, unit="B", unit_scale=True, desc="uploading", disable=not shown(), leave=False
        ) as bar:
            report = store.tier.drain(timeout, progress=bar.update)
        uri = store.objects.uri
    for step in report.uploaded:
        if as_json:
            click.echo(json.dumps({"step": step.step, "copied": step.copied, "bytes_copied": step.bytes_copied,
                                   "found": step.found}))  # fmt: skip
        else:
            click.echo(f"uploaded step {step.step} to {uri}: {step.copied} objects ({human(step.bytes_copied)}) "
                       f"copied, {step.found} already there")  # fmt: skip
    published = {step.step for step in report.uploaded}
    for rank, share in report.shares:
        if share.step in published or as_json:
            continue  # said with its step
        click.echo(f"uploaded rank {rank}'s share of step {share.step}: {share.copied} objects "
                   f"({human(share.bytes_copied)}) copied; the node holding its manifest publishes it")  # fmt: skip
    if not report.uploaded and not report.shares and not as_json:
        click.echo(f"nothing to upload: {uri} has every step of the tier")
