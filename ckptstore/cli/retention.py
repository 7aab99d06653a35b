"""``gc`` and ``delete``: which steps the store keeps."""

from __future__ import annotations

import json
import sys

import click

from .. import knobs
from .base import cli, human, open_store

_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


class Duration(click.ParamType):
    """A duration such as ``90s``, ``30m``, ``2h``, ``7d`` (plain numbers are seconds)."""

    name = "duration"

    def convert(self, value, param, ctx):
        if isinstance(value, (int, float)):
            value = str(value)
        text = str(value).strip().lower()
        unit = _DURATION_UNITS.get(text[-1:]) if text else None
        try:
            seconds = float(text[:-1]) * unit if unit else float(text)
        except ValueError:
            self.fail(f"{value!r} is not a duration like 90s, 30m, 2h or 7d", param, ctx)
        if not 0 <= seconds <= knobs.MAX_GRACE:  # nan would switch the grace period off
            self.fail(f"{value!r} is not a duration from 0 to ten years like 90s, 30m, 2h or 7d", param, ctx)
        return seconds


def _print_gc(report, as_json: bool, always: bool) -> None:
    if as_json:
        click.echo(json.dumps(report.as_dict()))
        return
    if not always:
        return
    verb = "would drop" if report.dry_run else "dropped"
    freed = "would free" if report.dry_run else "freed"
    dropped = ", ".join(map(str, report.steps_dropped)) if len(report.steps_dropped) <= 10 else (
        f"{len(report.steps_dropped)} steps")  # fmt: skip
    click.echo(f"{verb} {len(report.steps_dropped)} step(s){': ' + dropped if report.steps_dropped else ''}; "
               f"kept {len(report.steps_kept)}")  # fmt: skip
    if report.steps_thinned:
        would = "would make" if report.dry_run else "made"
        click.echo(f"{would} {len(report.steps_thinned)} step(s) weights-only ({report.layers_thinned} layer(s) "
                   f"rewritten without optimizer state): {', '.join(map(str, report.steps_thinned))}")  # fmt: skip
    files = f" and {report.files_freed} auxiliary file(s)" if report.files_freed else ""
    spared = report.blobs_spared + report.files_spared
    click.echo(f"{freed} {report.blobs_freed} pack(s) and blob(s){files}, {human(report.bytes_freed)}; "
               f"spared {spared} younger than the grace period ({human(report.bytes_spared)})")  # fmt: skip
    if report.temporary_freed:
        click.echo(f"{'would remove' if report.dry_run else 'removed'} {report.temporary_freed} unfinished "
                   f"write(s) left by killed commands ({human(report.temporary_bytes_freed)})")  # fmt: skip


@cli.command()
@click.option("--keep-last", type=click.IntRange(min=0), help="Keep the N newest steps.")
@click.option("--keep-every", type=click.IntRange(min=1), help="Keep every step divisible by K.")
@click.option("--keep-step", "keep_steps", type=int, multiple=True, help="Keep this step (repeatable).")
@click.option(
    "--keep-best", "keep_best", metavar="NAME:min|max[:COUNT]", multiple=True,
    help="Keep the COUNT (default 1) best steps by a metric recorded with the commit (repeatable).",
)  # fmt: skip
@click.option(
    "--keep-weights-every", type=click.IntRange(min=1), metavar="K",
    help="Of the steps no other rule keeps, keep those divisible by K with their weights only.",
)  # fmt: skip
@click.option(
    "--keep-weights-last", type=click.IntRange(min=1), metavar="N",
    help="Of the steps no other rule keeps, keep the N newest with their weights only.",
)  # fmt: skip
@click.option(
    "--grace", type=Duration(), default=None,
    help="Never delete unreferenced packs, blobs and files younger than this (e.g. 2h; default 1h or $CKPTSTORE_GC_GRACE seconds).",
)  # fmt: skip
@click.option("--dry-run", is_flag=True, help="Change nothing; print what would go and how many bytes.")
@click.option("--allow-empty", is_flag=True, help="Allow the rules to drop every step.")
@click.option("-v", "--verbose", is_flag=True, help="Print what was freed even when not on a terminal.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.pass_context
def gc(
    ctx,
    keep_last,
    keep_every,
    keep_steps,
    keep_best,
    keep_weights_every,
    keep_weights_last,
    grace,
    dry_run,
    allow_empty,
    verbose,
    as_json,
) -> None:
    """Drop steps the retention rules do not keep, then delete packs, blobs and files no kept step needs.

    Steps not kept by --keep-last, --keep-every, --keep-step or --keep-best are dropped, or
    kept with their weights only (no optimizer state: they export, they do not resume) by
    --keep-weights-every / --keep-weights-last; with no rule,
    no step is dropped and only unreferenced packs, blobs and auxiliary files go. Layers that kept (composite) steps
    inherit from dropped steps are kept. Safe to run from cron next to training jobs:
    commits and other gc runs may run at the same time. Quiet unless it fails (or on a
    terminal, or with -v).

    \b
    Example (crontab): 17 * * * * ckptstore --store /data/run7 gc --keep-last 5 --keep-every 1000
    Never lose the best evaluation: ckptstore gc --keep-last 3 --keep-best eval_loss:min
    Older steps as weights only:    ckptstore gc --keep-last 3 --keep-weights-every 1000
    """
    with open_store(ctx, through_tier=False) as store:
        report = store.gc(
            keep_last=keep_last, keep_every=keep_every, keep_steps=keep_steps, keep_best=keep_best, grace=grace,
            keep_weights_every=keep_weights_every, keep_weights_last=keep_weights_last,
            dry_run=dry_run, allow_empty=allow_empty,
        )  # fmt: skip
    _print_gc(report, as_json, always=dry_run or verbose or sys.stdout.isatty())


@cli.command()
@click.option("--step", type=int, required=True, help="The step to drop.")
@click.option("--dry-run", is_flag=True, help="Change nothing; say what would happen.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.pass_context
def delete(ctx, step, dry_run, as_json) -> None:
    """Drop one step's record. Its blobs are deleted by the next gc, unless other steps need them.

    Example: ckptstore --store runs/store delete --step 400
    """
    with open_store(ctx, through_tier=False) as store:
        report = store.delete(step, dry_run=dry_run)
    if as_json:
        click.echo(json.dumps(report.as_dict()))
    else:
        click.echo(f"{'would drop' if dry_run else 'dropped'} step {step}; its blobs go at the next gc")
