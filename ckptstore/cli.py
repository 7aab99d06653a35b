"""The ``ckptstore`` command line: parsing and printing over the library, nothing more.

Exit codes: 0 success; 1 ``verify`` found problems; 2 bad usage or input; 3 not found
(step, store, blob); 4 corrupt data; 5 conflict (e.g. non-empty output directory);
6 unsupported engine or store format; 7 storage failure; 70 internal error.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict

import click

from . import opening
from .errors import CkptStoreError
from .store import Store

EXIT_PROBLEMS = 1
EXIT_INTERNAL = 70


def _store_option(command):
    # Accepted before or after the command name: `ckptstore --store X log` = `ckptstore log --store X`.
    return click.option(
        "--store", "store_uri", metavar="URI", default=None, help="The store (overrides the group option)."
    )(command)


def _store_uri(ctx: click.Context) -> str:
    uri = ctx.params.get("store_uri") or ctx.obj["store"]
    if not uri:
        raise click.UsageError("no store given: pass --store URI or set CKPTSTORE_STORE")
    return uri


def _open(ctx: click.Context) -> Store:
    return opening.open(_store_uri(ctx), create=False)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--store",
    envvar="CKPTSTORE_STORE",
    metavar="URI",
    help="The store: a directory path, file:// or s3://bucket/prefix URI. Defaults to $CKPTSTORE_STORE.",
)
@click.version_option(package_name="ckptstore")
@click.pass_context
def cli(ctx: click.Context, store: str | None) -> None:
    """Content-addressed, deduplicated DeepSpeed checkpoints.

    Training code commits with ``ckptstore.open(URI).commit(engine, step)``; these
    commands list, check and rebuild what was committed.
    """
    ctx.ensure_object(dict)
    ctx.obj["store"] = store


@cli.command()
@click.option("--step", type=int, default=None, help="The committed step to rebuild.")
@click.option(
    "--spec", type=click.Path(dir_okay=False), default=None,
    help="Instead of --step: a compose spec (YAML) naming the step of each layer range.",
)  # fmt: skip
@click.option(
    "--world-size", type=click.IntRange(min=1), default=None,
    help="Data-parallel size of the job that will load it (default: the committing job's).",
)  # fmt: skip
@click.option("--force", is_flag=True, help="Replace OUT if it exists and is not empty.")
@click.option(
    "--tag", default=None,
    help="Name of the checkpoint folder in OUT, and what `latest` says (default global_step<STEP>; "
    "accelerate's save_state uses pytorch_model).",
)  # fmt: skip
@click.argument("out", type=click.Path(file_okay=False))
@_store_option
@click.pass_context
def materialize(
    ctx: click.Context,
    store_uri: str | None,
    step: int | None,
    spec: str | None,
    world_size: int | None,
    force: bool,
    tag: str | None,
    out: str,
) -> None:
    """Write step STEP (or the checkpoint a compose spec describes) as a DeepSpeed directory OUT.

    OUT gets ``latest``, ``global_step<STEP>/`` (or ``--tag``'s name) and the step's auxiliary
    files; resume with ``engine.load_checkpoint(OUT)``. OUT appears only once complete.

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
    """
    if step is None and spec is None:
        raise click.UsageError("Missing option '--step' (or --spec)")
    if step is not None and spec is not None:
        raise click.UsageError("--step and --spec exclude each other")
    with _open(ctx) as store:
        path = store.materialize(step, out, spec=spec, world_size=world_size, force=force, tag=tag)
    click.echo(f"materialized {f'step {step}' if spec is None else spec} at {path}")


def _update(value: float | None) -> str:
    return "-" if value is None else f"{value:.2e}"


@cli.command()
@click.option("--step", type=int, required=True, help="The committed step to describe.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object per layer.")
@_store_option
@click.pass_context
def show(ctx: click.Context, store_uri: str | None, step: int, as_json: bool) -> None:
    """List the layers of step STEP: the step each comes from, its bytes, its update.

    The update is the relative change of the layer's fp32 master weights since the step
    that last saved it (||w - w_prev|| / ||w_prev||, estimated from a fixed sample of each
    parameter), measured when STEP was committed; "-" where nothing could be compared.

    Example: ckptstore --store runs/store show --step 400
    """
    with _open(ctx) as store:
        rows = store.show(step)
    if as_json:
        for row in rows:
            click.echo(json.dumps(asdict(row)))
        return
    width = max(len("layer"), *(len(row.layer) for row in rows))
    click.echo(f"{'layer':<{width}}  {'from step':>10}  {'bytes':>10}  {'update':>9}  {'since':>6}")
    for row in rows:
        since = "-" if row.update_since is None else str(row.update_since)
        click.echo(
            f"{row.layer:<{width}}  {row.source:>10}  {_human(row.bytes):>10}  {_update(row.update):>9}  {since:>6}"
        )
    saved = sum(1 for row in rows if row.source == step)
    total = _human(sum(row.bytes for row in rows))
    click.echo(f"{saved} of {len(rows)} layers saved at step {step}; {total} in all")


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object per step.")
@_store_option
@click.pass_context
def log(ctx: click.Context, store_uri: str | None, as_json: bool) -> None:
    """List committed steps: when, how many layers each saved, bytes it added.

    Example: ckptstore --store runs/store log
    """
    with _open(ctx) as store:
        rows = store.log()
    if as_json:
        for row in rows:
            click.echo(json.dumps(asdict(row)))
        return
    if not rows:
        click.echo("no steps committed yet")
        return
    click.echo(
        f"{'step':>10}  {'committed (UTC)':<25} {'layers saved':>12}  {'objects added':>13}  {'bytes added':>11}"
    )
    for row in rows:
        saved = f"{row.layers_saved}/{row.layers_total}"
        click.echo(
            f"{row.step:>10}  {row.created_at:<25} {saved:>12}  {row.blobs_added:>13}  {_human(row.bytes_added):>11}"
        )


@cli.command()
@click.option("--fast", is_flag=True, help="Only check presence, size and header (no re-hash).")
@click.option("--deep", is_flag=True, help="Decode and re-hash every blob (the default).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@_store_option
@click.pass_context
def verify(ctx: click.Context, store_uri: str | None, fast: bool, deep: bool, as_json: bool) -> None:
    """Check that every blob and auxiliary file a committed step needs is present and hashes to its key.

    Exit code 0 when clean, 1 when problems were found. Unreferenced packs and blobs (orphans),
    manifests of interrupted commits and stray objects (names under packs/, blobs/, files/ or
    manifests/ that ckptstore does not write) are reported but are not problems.

    Example: ckptstore --store runs/store verify
    """
    if fast and deep:
        raise click.UsageError("--fast and --deep exclude each other")
    with _open(ctx) as store:
        report = store.verify(deep=not fast)
    if as_json:
        click.echo(json.dumps(report.as_dict()))
    else:
        for problem in [*report.problems, *report.file_problems]:
            click.echo(f"problem: {problem.describe()}")
        for problem in report.catalog_problems:
            click.echo(f"problem: {problem}")
        if report.orphans:
            click.echo(f"info: {len(report.orphans)} blob(s) no step references (gc removes them)")
        if report.stray_manifests:
            click.echo(
                f"info: manifests of uncommitted steps {report.stray_manifests} (left by interrupted commits)"
            )
        if report.stray_objects:
            shown = ", ".join(report.stray_objects[:5]) + (", ..." if len(report.stray_objects) > 5 else "")
            click.echo(
                f"info: {len(report.stray_objects)} object(s) whose names ckptstore does not write: {shown} "
                "(left alone by gc)"
            )
        mode = "re-hashed" if report.deep else "checked"
        verdict = (
            "clean"
            if report.ok
            else f"{len(report.problems) + len(report.file_problems) + len(report.catalog_problems)} problem(s)"
        )
        files = f" and {report.files_checked} auxiliary file(s)" if report.files_checked else ""
        click.echo(
            f"{report.blobs_checked} packs and blobs ({_human(report.bytes_checked)}){files} {mode}: {verdict}"
        )
    if not report.ok:
        sys.exit(EXIT_PROBLEMS)


_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


class Duration(click.ParamType):
    """A duration such as ``90s``, ``30m``, ``2h``, ``7d`` (plain numbers are seconds)."""

    name = "duration"

    def convert(self, value, param, ctx):
        if isinstance(value, (int, float)):
            return float(value)
        text = str(value).strip().lower()
        unit = _DURATION_UNITS.get(text[-1:]) if text else None
        try:
            seconds = float(text[:-1]) * unit if unit else float(text)
        except ValueError:
            self.fail(f"{value!r} is not a duration like 90s, 30m, 2h or 7d", param, ctx)
        if seconds < 0:
            self.fail(f"{value!r} is negative", param, ctx)
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
    files = f" and {report.files_freed} auxiliary file(s)" if report.files_freed else ""
    spared = report.blobs_spared + report.files_spared
    click.echo(f"{freed} {report.blobs_freed} pack(s) and blob(s){files}, {_human(report.bytes_freed)}; "
               f"spared {spared} younger than the grace period ({_human(report.bytes_spared)})")  # fmt: skip


@cli.command()
@click.option("--keep-last", type=click.IntRange(min=0), help="Keep the N newest steps.")
@click.option("--keep-every", type=click.IntRange(min=1), help="Keep every step divisible by K.")
@click.option("--keep-step", "keep_steps", type=int, multiple=True, help="Keep this step (repeatable).")
@click.option(
    "--grace", type=Duration(), default=None,
    help="Never delete unreferenced packs, blobs and files younger than this (e.g. 2h; default 1h or $CKPTSTORE_GC_GRACE seconds).",
)  # fmt: skip
@click.option("--dry-run", is_flag=True, help="Change nothing; print what would go and how many bytes.")
@click.option("--allow-empty", is_flag=True, help="Allow the rules to drop every step.")
@click.option("-v", "--verbose", is_flag=True, help="Print what was freed even when not on a terminal.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@_store_option
@click.pass_context
def gc(
    ctx, store_uri, keep_last, keep_every, keep_steps, grace, dry_run, allow_empty, verbose, as_json
) -> None:
    """Drop steps the retention rules do not keep, then delete packs, blobs and files no kept step needs.

    Steps not kept by --keep-last, --keep-every or --keep-step are dropped; with no rule,
    no step is dropped and only unreferenced packs, blobs and auxiliary files go. Layers that kept (composite) steps
    inherit from dropped steps are kept. Safe to run from cron next to training jobs:
    commits and other gc runs may run at the same time. Quiet unless it fails (or on a
    terminal, or with -v).

    Example (crontab): 17 * * * * ckptstore --store /data/run7 gc --keep-last 5 --keep-every 1000
    """
    with _open(ctx) as store:
        report = store.gc(
            keep_last=keep_last, keep_every=keep_every, keep_steps=keep_steps, grace=grace,
            dry_run=dry_run, allow_empty=allow_empty,
        )  # fmt: skip
    _print_gc(report, as_json, always=dry_run or verbose or sys.stdout.isatty())


@cli.command()
@click.option("--step", type=int, required=True, help="The step to drop.")
@click.option("--dry-run", is_flag=True, help="Change nothing; say what would happen.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@_store_option
@click.pass_context
def delete(ctx, store_uri, step, dry_run, as_json) -> None:
    """Drop one step's record. Its blobs are deleted by the next gc, unless other steps need them.

    Example: ckptstore --store runs/store delete --step 400
    """
    with _open(ctx) as store:
        report = store.delete(step, dry_run=dry_run)
    if as_json:
        click.echo(json.dumps(report.as_dict()))
    else:
        click.echo(f"{'would drop' if dry_run else 'dropped'} step {step}; its blobs go at the next gc")


@cli.group()
def catalog() -> None:
    """The catalog: the SQLite index of the steps in the store."""


@catalog.command()
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@_store_option
@click.pass_context
def rebuild(ctx: click.Context, store_uri: str | None, as_json: bool) -> None:
    """Rebuild the catalog from the step manifests in the store.

    For an S3 store that is the local index under $CKPTSTORE_CACHE: any machine rebuilds it
    from the bucket alone. For a local store it is catalog.db, e.g. after it was lost or
    corrupted. Steps whose manifest is unreadable or whose blobs are missing are left out
    and reported (exit code 1). Run it while no other process uses the catalog.

    Example: ckptstore --store s3://ckpts/llama-8b/run7 catalog rebuild
    """
    uri = _store_uri(ctx)
    report = opening.rebuild_catalog(uri)
    if as_json:
        click.echo(json.dumps(asdict(report)))
    else:
        for problem in report.corrupt:
            click.echo(f"problem: unreadable manifest {problem}")
        for step in report.incomplete:
            click.echo(f"problem: step {step} left out: blobs it needs are missing")
        steps = report.steps
        listed = ", ".join(map(str, steps)) if len(steps) <= 10 else f"{steps[0]}, ... {steps[-1]}"
        click.echo(f"rebuilt the catalog of {uri}: {len(steps)} step(s){': ' + listed if steps else ''}")
    if report.corrupt or report.incomplete:
        sys.exit(EXIT_PROBLEMS)


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the CLI, turning ckptstore errors into one line and an exit code."""
    try:
        cli.main(args=argv, prog_name="ckptstore", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except CkptStoreError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        sys.exit(130)
    except Exception as exc:  # a bug: one line, and the traceback only on request
        if os.environ.get("CKPTSTORE_DEBUG"):
            raise
        click.echo(
            f"internal error: {type(exc).__name__}: {exc} (set CKPTSTORE_DEBUG=1 for a traceback)", err=True
        )
        sys.exit(EXIT_INTERNAL)


if __name__ == "__main__":
    main()
