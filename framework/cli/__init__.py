"""The ``shardlight`` command: ``main`` assembles one parser from one module per command.

The top layer: it may import anything of shardlight's; nothing imports it.
"""

from shardlight.cli.main import main

__all__ = ["main"]
