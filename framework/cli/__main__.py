"""``python -m shardlight.cli``: the same as the ``shardlight`` script."""

from shardlight.cli.main import run

run()
