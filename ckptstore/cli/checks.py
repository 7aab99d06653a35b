"""``verify`` and ``catalog rebuild``: checking the store and rebuilding its index."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict

import click

from .. import opening
from .base import EXIT_PROBLEMS, cli, human, key_of, open_store, uri_of


@cli.command()
@click.option("--fast", is_flag=True, help="Only check presence, size and header (no re-hash).")
@click.option("--deep", is_flag=True, help="Decode and re-hash every blob (the default).")
@click.option(
    "--quarantine",
    is_flag=True,
    help="Then move the manifests that cannot be read or authenticated to quarantine/ (kept), so gc runs.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.pass_context
def verify(ctx: click.Context, fast: bool, deep: bool, quarantine: bool, as_json: bool) -> None:
    """Check that every blob and auxiliary file a committed step needs is present and hashes to its key.

    Every step's manifest is read and compared with the catalog. Without --fast, an auxiliary
    file kept as plain data that does not rebuild, and a DCP bytes item materialize refuses (kept
    as bytes, not plain data), are problems too. Exit code 0 when clean, 1 when
    problems were found (a missing, unreadable or disagreeing manifest is one). Unreferenced
    packs and blobs (orphans) and stray objects (names under packs/, blobs/, files/ or
    manifests/ that ckptstore does not write) are reported but are not problems.

    gc refuses to run while a manifest cannot be read or, with a key, is not authentic.
    --quarantine moves those manifests to quarantine/ in the store (copied, never deleted;
    no longer steps) and prints each; gc then runs, and frees the packs only they named.

    Example: ckptstore --store runs/store verify
    """
    if fast and deep:
        raise click.UsageError("--fast and --deep exclude each other")
    with open_store(ctx, through_tier=False) as store:
        report = store.verify(deep=not fast, quarantine=quarantine)
    if as_json:
        click.echo(json.dumps(report.as_dict()))
    else:
        for problem in [*report.problems, *report.file_problems]:
            click.echo(f"problem: {problem.describe()}")
        for problem in [*report.manifest_problems, *report.catalog_problems]:
            click.echo(f"problem: {problem}")
        if report.orphans:
            click.echo(f"info: {len(report.orphans)} blob(s) no step references (gc removes them)")
        if report.stray_objects:
            shown = ", ".join(report.stray_objects[:5]) + (", ..." if len(report.stray_objects) > 5 else "")
            click.echo(
                f"info: {len(report.stray_objects)} object(s) whose names ckptstore does not write: {shown} "
                "(left alone by gc)"
            )
        if report.buried_manifests:
            click.echo(
                f"info: {len(report.buried_manifests)} manifest(s) of deleted steps: "
                f"{', '.join(report.buried_manifests[:5])}{', ...' if len(report.buried_manifests) > 5 else ''} "
                + (
                    "(not steps; kept, with what they need: without a key a deletion record alone deletes "
                    "nothing; `ckptstore delete --step N` removes them)"
                    if report.buried_kept
                    else "(not steps; gc removes them)"
                )
            )
        for name, target in report.quarantined.items():
            click.echo(f"quarantined: {name} -> {target}")
        if report.temporary:
            click.echo(
                f"info: {report.temporary} unfinished write(s) ({human(report.temporary_bytes)}), in flight or "
                "left by killed commands (gc removes those older than the grace period)"
            )
        mode = "re-hashed" if report.deep else "checked"
        problems = [report.problems, report.file_problems, report.catalog_problems, report.manifest_problems]
        verdict = "clean" if report.ok else f"{sum(map(len, problems))} problem(s)"
        files = f" and {report.files_checked} auxiliary file(s)" if report.files_checked else ""
        click.echo(
            f"{report.manifests_checked} manifests, {report.blobs_checked} packs and blobs "
            f"({human(report.bytes_checked)}){files} {mode}: {verdict}"
        )
    if not report.ok:
        sys.exit(EXIT_PROBLEMS)


@cli.group()
def catalog() -> None:
    """The catalog: the SQLite index of the steps in the store."""


@catalog.command()
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.pass_context
def rebuild(ctx: click.Context, as_json: bool) -> None:
    """Rebuild the catalog from the step manifests in the store.

    For an S3 store that is the local index under $CKPTSTORE_CACHE: any machine rebuilds it
    from the bucket alone. For a local store it is catalog.db, e.g. after it was lost or
    corrupted (opening the store also rebuilds a catalog SQLite cannot read). Steps whose
    manifest is unreadable or whose blobs are missing, and steps the old catalog had whose
    manifest is gone, are left out and reported (exit code 1; the old catalog is then kept
    beside the new one). Run it while no other process uses the catalog.

    Example: ckptstore --store s3://ckpts/llama-8b/run7 catalog rebuild
    """
    uri = uri_of(ctx)
    report = opening.rebuild_catalog(uri, key=key_of(ctx))
    if as_json:
        click.echo(json.dumps(asdict(report)))
    else:
        for problem in report.corrupt:
            click.echo(f"problem: unreadable manifest {problem}")
        for step in report.incomplete:
            click.echo(f"problem: step {step} left out: blobs it needs are missing")
        for step in report.lost:
            click.echo(f"problem: step {step} left out: the old catalog had it, but its manifest is gone")
        if report.kept_aside:
            click.echo(f"info: the previous catalog is kept at {report.kept_aside}")
        steps = report.steps
        listed = ", ".join(map(str, steps)) if len(steps) <= 10 else f"{steps[0]}, ... {steps[-1]}"
        click.echo(f"rebuilt the catalog of {uri}: {len(steps)} step(s){': ' + listed if steps else ''}")
    if report.corrupt or report.incomplete or report.lost:
        sys.exit(EXIT_PROBLEMS)
