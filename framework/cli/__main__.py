"""``python -m shardlight.cli``: the same as the ``shardlight`` script."""

import sys

from shardlight.cli.main import main

sys.exit(main())
