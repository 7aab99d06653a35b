"""The ``ckptstore`` group and what its commands share: the store option, opening it, sizes."""

from __future__ import annotations

import click

from .. import keys, knobs, opening
from ..store import Store

EXIT_PROBLEMS = 1
EXIT_INTERNAL = 70


# The group's options: each is accepted before the command (`ckptstore --local X drain`) or
# after it (`ckptstore drain --local X`), as restic's global flags are. Given after, it wins.
_GROUP_OPTIONS = {
    "store": ("--store", "URI", "The store: a directory path, file:// or s3://bucket/prefix URI. Defaults to $CKPTSTORE_STORE."),
    "local": ("--local", "DIR", "This node's local tier in front of the store (steps not uploaded yet, fast reads). "
              "Defaults to $CKPTSTORE_LOCAL."),
    "key_file": ("--key-file", "FILE", "The file holding the store's key (a store created with a key opens only with "
                 "it; the file must not be readable by others). Defaults to $CKPTSTORE_KEY_FILE."),
}  # fmt: skip


def _given_after(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    # Parsed after the group's callback ran, so it overrides what the group was given.
    if value is not None:
        ctx.find_root().obj[param.name] = value


def accept_group_options_after_commands(group: click.Group) -> None:
    """Give every command under ``group`` the group's options (``_GROUP_OPTIONS``), so that a
    command line reads the same with them before or after the command name."""
    for command in group.commands.values():
        names = {param.name for param in command.params}
        for name, (flag, metavar, text) in _GROUP_OPTIONS.items():
            if name not in names:
                command.params.append(
                    click.Option(
                        [flag, name],
                        metavar=metavar,
                        expose_value=False,
                        callback=_given_after,
                        help=f"{text} Also accepted before the command.",
                    )  # fmt: skip
                )
        if isinstance(command, click.Group):
            accept_group_options_after_commands(command)


def uri_of(ctx: click.Context) -> str:
    """The store URI the command was given (``--store`` before or after the command, else
    ``$CKPTSTORE_STORE``); UsageError if none."""
    uri = ctx.find_root().obj.get("store")
    if not uri:
        raise click.UsageError("no store given: pass --store URI or set CKPTSTORE_STORE")
    return uri


def open_store(ctx: click.Context, *, through_tier: bool = True) -> Store:
    """Open the command's store; it must exist. Through the local tier the group was given
    (``--local``, ``$CKPTSTORE_LOCAL``), unless ``through_tier`` is false (gc, delete and verify
    work on the store itself). Given only the tier, the store is the one the tier fronts."""
    local = ctx.find_root().obj.get("local") or "" if through_tier else ""
    if local and not ctx.find_root().obj.get("store"):
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


def _group_option(name: str, envvar: str | None = None):
    flag, metavar, text = _GROUP_OPTIONS[name]
    return click.option(flag, name, envvar=envvar, metavar=metavar, help=text)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@_group_option("store", envvar="CKPTSTORE_STORE")
@_group_option("local", envvar="CKPTSTORE_LOCAL")
@_group_option("key_file")
@click.version_option(package_name="ckptstore")
@click.pass_context
def cli(ctx: click.Context, store: str | None, local: str | None, key_file: str | None) -> None:
    """Content-addressed, deduplicated DeepSpeed checkpoints.

    Training code commits with ``ckptstore.open(URI).commit(engine, step)``; these
    commands list, check and rebuild what was committed. The options above may come after
    the command too. Every CKPTSTORE_* setting is checked before the command runs (exit 2
    naming a bad one).
    """
    knobs.check_all()
    ctx.ensure_object(dict)
    ctx.obj["store"] = store
    ctx.obj["local"] = local
    ctx.obj["key_file"] = key_file
