"""The ``shardlight`` command: ``cli.main`` assembles one parser from one module per command (``main`` is the
console entry point). The top of the tree: it may import anything of shardlight's; nothing imports it.
"""
