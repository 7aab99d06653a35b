"""``python -m ckptstore.cli``."""

from . import main

main()
