"""``log`` and ``show``: what the store holds, step by step."""

from __future__ import annotations

import json
from dataclasses import asdict

import click

from ..errors import CorruptError
from .base import cli, human, open_store


def _update(value: float | None) -> str:
    return "-" if value is None else f"{value:.2e}"


@cli.command()
@click.option("--step", type=int, required=True, help="The committed step to describe.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object per layer.")
@click.pass_context
def show(ctx: click.Context, step: int, as_json: bool) -> None:
    """List the layers of step STEP: the step each comes from, its bytes, its update.

    The update is the relative change of the layer's fp32 master weights since the step
    that last saved it (||w - w_prev|| / ||w_prev||, estimated from a fixed sample of each
    parameter), measured when STEP was committed; "-" where nothing could be compared.

    Example: ckptstore --store runs/store show --step 400
    """
    with open_store(ctx) as store:
        rows = store.show(step)
        resumable = store.resumable(step)
    if as_json:
        for row in rows:
            click.echo(json.dumps({**asdict(row), "resumable": resumable}))
        return
    width = max(len("layer"), *(len(row.layer) for row in rows))
    click.echo(f"{'layer':<{width}}  {'from step':>10}  {'bytes':>10}  {'update':>9}  {'since':>6}")
    for row in rows:
        since = "-" if row.update_since is None else str(row.update_since)
        click.echo(
            f"{row.layer:<{width}}  {row.source:>10}  {human(row.bytes):>10}  {_update(row.update):>9}  {since:>6}"
        )
    saved = sum(1 for row in rows if row.source == step)
    total = human(sum(row.bytes for row in rows))
    click.echo(f"{saved} of {len(rows)} layers saved at step {step}; {total} in all")
    if not resumable:
        click.echo(f"step {step} is weights-only: it exports (ckptstore export), it does not resume")


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object per step.")
@click.pass_context
def log(ctx: click.Context, as_json: bool) -> None:
    """List committed steps: when, how many layers each saved, bytes it added, whether it
    resumes ("weights": gc kept its weights only), metrics; for commits behind training, the
    seconds each took and held training (stall), and the steps before it that were replaced
    or skipped (commit(when_busy=...)). A step whose manifest cannot be
    read is named after the others (exit 4: run `ckptstore verify`). With a local tier
    (--local), where each step is: "local" (not uploaded yet), "both", or only in the store.

    Example: ckptstore --store runs/store log
    """
    with open_store(ctx) as store:
        rows = store.log()
        unreadable = store.unreadable_steps()
        where = _where(store) if store.tier is not None else None
    if as_json:
        for row in rows:
            click.echo(json.dumps(asdict(row) | ({"where": where[row.step]} if where else {})))
    elif rows:
        _print_log(rows, where)
    elif not unreadable:
        click.echo("no steps committed yet")
    if unreadable:  # listed above are the others; a damaged step is not a missing one
        step, why = min(unreadable.items())
        more = f" (and {len(unreadable) - 1} more)" if len(unreadable) > 1 else ""
        raise CorruptError(f"step {step} is committed but cannot be read{more}: manifest {why}")


def _where(store) -> dict[int, str]:
    """Each step's place with a local tier: local, both, or the store's scheme (s3)."""
    remote = store.objects.uri.split("://", 1)[0] if "://" in store.objects.uri else "store"
    return {step: remote if place == "store" else place for step, place in store.locations().items()}


def _print_log(rows: list, where: dict[int, str] | None = None) -> None:
    """The log as a table, one line per step; ``where`` adds a column (a store with a local tier)."""
    with_metrics = any(row.metrics for row in rows)
    # commits behind training: how long each held training, and the steps it did not commit
    queued = any(row.stall_seconds is not None or row.not_committed for row in rows)
    click.echo(
        f"{'step':>10}  {'committed (UTC)':<25} {'layers saved':>12}  {'objects added':>13}  {'bytes added':>11}"
        + "  resumes"
        + ("  where" if where else "")
        + (f"  {'commit s':>8}  {'stall s':>8}" if queued else "")
        + ("  metrics" if with_metrics else "")
    )
    for row in rows:
        saved = f"{row.layers_saved}/{row.layers_total}"
        metrics = " ".join(f"{name}={_metric(value)}" for name, value in row.metrics.items())
        click.echo(
            f"{row.step:>10}  {row.created_at:<25} {saved:>12}  {row.blobs_added:>13}  {human(row.bytes_added):>11}"
            + ("  yes    " if row.resumable else "  weights")
            + (f"  {where.get(row.step, '-'):<5}" if where else "")
            + (f"  {_seconds(row.commit_seconds):>8}  {_seconds(row.stall_seconds):>8}" if queued else "")
            + (f"  {metrics}" if metrics else "")
        )
        if row.not_committed:
            click.echo(f"{'':>10}  not committed before it: {_not_committed(row.not_committed)}")


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _not_committed(pairs: list[tuple[int, str]]) -> str:
    """``replaced 2, 3; skipped 5``: the steps a commit behind training did not commit."""
    by_outcome: dict[str, list[str]] = {}
    for step, outcome in pairs:
        by_outcome.setdefault(outcome, []).append(str(step))
    return "; ".join(f"{outcome} {', '.join(steps)}" for outcome, steps in sorted(by_outcome.items()))


def _metric(value: float | None) -> str:
    return "nan" if value is None else f"{value:.6g}"


@cli.command()
@click.option("--steps", "steps", default=None, metavar="A..B",
              help="The steps to show: A..B, A.., ..B or one step (default: all).")  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Print the figures as one JSON object (OUT optional).")
@click.option("--force", is_flag=True, help="Replace OUT if an earlier report (or materialize) wrote it.")
@click.argument("out", required=False, type=click.Path(file_okay=False))
@click.pass_context
def report(ctx: click.Context, steps: str | None, as_json: bool, force: bool, out: str | None) -> None:
    """Draw what the store saw into folder OUT: PNG charts and an index.html with the numbers.

    A heatmap of each layer's update at each step (x: the layers that step saved), logical
    vs stored bytes per step and cumulative, the dedup ratio, and the seconds each commit
    and (through a local tier) each upload took; figures.json holds the numbers. The charts need matplotlib (pip install 'ckptstore[report]'); --json prints the
    figures without it. A step of the range whose manifest cannot be read is exit 4 naming it.
    The figures are the catalog's: report reads no pack, so a missing or damaged one shows
    only in `ckptstore verify`.

    Example: ckptstore --store runs/store report --steps 100..900 runs/report
    """
    if out is None and not as_json:
        raise click.UsageError("give an output folder OUT, or --json")
    with open_store(ctx) as store:
        figures = store.report(out, steps=steps, force=force)
    if as_json:
        click.echo(json.dumps(figures.as_json()))
    else:
        ratio = "-" if figures.dedup_ratio is None else f"{figures.dedup_ratio:.2f}x"
        click.echo(
            f"reported steps {figures.steps[0]} to {figures.steps[-1]} at {out} (logical / stored: {ratio})"
        )
