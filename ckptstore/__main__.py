"""``python -m ckptstore``: the ``ckptstore`` command line."""

from .cli import main

main()
