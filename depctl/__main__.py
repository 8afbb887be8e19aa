"""``python -m depctl``: the CLI, for environments where the ``depctl`` script is not on PATH."""

from depctl.cli import main

main()
