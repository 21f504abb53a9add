"""``python -m safeview``: the same as the ``safeview`` command."""

from safeview.cli import command

command()
