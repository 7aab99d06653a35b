"""The ``ckptstore`` command line: parsing and printing over the library, nothing more.

Exit codes: 0 success; 1 ``verify`` found problems; 2 bad usage or input; 3 not found
(step, store, blob); 4 corrupt data; 5 conflict (e.g. non-empty output directory);
6 unsupported engine or store format; 7 storage failure; 8 the step keeps only its weights
(materialize of a weights-only step); 70 internal error.
"""

from __future__ import annotations

import logging
import sys

import click

from .. import knobs
from ..errors import CkptStoreError, clip, redact
from . import checkpoints, checks, retention, steps, tier  # noqa: F401  (each registers its commands)
from .base import EXIT_INTERNAL, accept_group_options_after_commands, cli

__all__ = ["cli", "main"]

accept_group_options_after_commands(cli)


class _Warnings(logging.Handler):
    """ckptstore's warnings on the standard error the CLI writes to now (one line each), so
    they reach a terminal or cron's mail however logging is configured around it."""

    def emit(self, record: logging.LogRecord) -> None:
        click.echo(clip(redact(record.getMessage()), 600), err=True)


def _show_warnings() -> None:
    logger = logging.getLogger("ckptstore")
    if not any(isinstance(handler, _Warnings) for handler in logger.handlers):
        handler = _Warnings(logging.WARNING)
        logger.addHandler(handler)  # logging's last resort then stays out: each shows once


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the CLI, turning ckptstore errors into one line and an exit code."""
    _show_warnings()
    try:
        cli.main(args=argv, prog_name="ckptstore", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except CkptStoreError as exc:
        # One line of a few hundred characters, never an endpoint's user:password@.
        click.echo(f"error: {clip(redact(str(exc)), 380)}", err=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        sys.exit(130)
    except Exception as exc:  # a bug: one line, and the traceback only on request
        if _debug():
            raise
        click.echo(
            f"internal error: {type(exc).__name__}: {clip(redact(str(exc)), 300)} (set CKPTSTORE_DEBUG=1 for a traceback)",
            err=True,
        )
        sys.exit(EXIT_INTERNAL)


def _debug() -> bool:
    """``CKPTSTORE_DEBUG``, read where any error is being reported: a bad value is no traceback."""
    try:
        return knobs.debug()
    except CkptStoreError:
        return False
