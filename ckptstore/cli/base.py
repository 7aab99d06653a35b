"""The ``ckptstore`` group and what its commands share: the store option, opening it, sizes."""

from __future__ import annotations

import click

from .. import opening
from ..store import Store

EXIT_PROBLEMS = 1
EXIT_INTERNAL = 70


def store_option(command):
    """Add ``--store`` to a command.

    Accepted before or after the command name: `ckptstore --store X log` = `ckptstore log --store X`."""
    return click.option(
        "--store", "store_uri", metavar="URI", default=None, help="The store (overrides the group option)."
    )(command)


def uri_of(ctx: click.Context) -> str:
    """The store URI the command was given (its own option, else the group's); UsageError if none."""
    uri = ctx.params.get("store_uri") or ctx.obj["store"]
    if not uri:
        raise click.UsageError("no store given: pass --store URI or set CKPTSTORE_STORE")
    return uri


def open_store(ctx: click.Context) -> Store:
    """Open the command's store; it must exist."""
    return opening.open(uri_of(ctx), create=False)


def human(n: float) -> str:
    """A byte count for people: ``1.5 MiB``."""
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
