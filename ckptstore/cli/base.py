"""The ``ckptstore`` group and what its commands share: the store option, opening it, sizes."""

from __future__ import annotations

import click

from .. import keys, opening
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


def open_store(ctx: click.Context, *, through_tier: bool = True) -> Store:
    """Open the command's store; it must exist. Through the local tier the group was given
    (``--local``, ``$CKPTSTORE_LOCAL``), unless ``through_tier`` is false (gc, delete and verify
    work on the store itself). Given only the tier, the store is the one the tier fronts."""
    local = ctx.obj.get("local") or "" if through_tier else ""
    if local and not (ctx.params.get("store_uri") or ctx.obj["store"]):
        return opening.open_local_tier(local, key=key_of(ctx))
    # A command reads through the tier; uploading is drain's job, never a side effect of `log`.
    return opening.open(uri_of(ctx), create=False, local=local, local_upload="drain", key=key_of(ctx))


def key_of(ctx: click.Context) -> bytes | None:
    """The key in the file ``--key-file`` named; None without one (``CKPTSTORE_KEY_FILE`` then
    applies, as it does to ``ckptstore.open``)."""
    path = ctx.find_root().obj.get("key_file")
    return keys.read_key_file(path) if path else None


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
@click.option(
    "--local",
    envvar="CKPTSTORE_LOCAL",
    metavar="DIR",
    help="This node's local tier in front of the store (steps not uploaded yet, fast reads). "
    "Defaults to $CKPTSTORE_LOCAL.",
)
@click.option(
    "--key-file",
    metavar="FILE",
    help="The file holding the store's key (a store created with a key opens only with it; "
    "the file must not be readable by others). Defaults to $CKPTSTORE_KEY_FILE.",
)
@click.version_option(package_name="ckptstore")
@click.pass_context
def cli(ctx: click.Context, store: str | None, local: str | None, key_file: str | None) -> None:
    """Content-addressed, deduplicated DeepSpeed checkpoints.

    Training code commits with ``ckptstore.open(URI).commit(engine, step)``; these
    commands list, check and rebuild what was committed.
    """
    ctx.ensure_object(dict)
    ctx.obj["store"] = store
    ctx.obj["local"] = local
    ctx.obj["key_file"] = key_file
