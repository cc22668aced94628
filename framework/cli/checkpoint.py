"""``shardlight export`` and ``shardlight inspect``."""

from __future__ import annotations

from shardlight.export import add_checkpoint_parsers


def add_parsers(subparsers) -> None:
    add_checkpoint_parsers(subparsers)
