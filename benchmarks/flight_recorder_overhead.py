"""Overhead of what every run keeps for a hang (``docs/hangs.md``): torch's flight recorder
(``trainer.flight_recorder_entries``, 2000) and the hang watchdog (``callbacks.hang``), on and off, on the default
recipe, 2 gloo ranks. The runs and their metrics are ``comm_callback_overhead.py``'s (``--arms recorder``: the comm
callback off in both arms); target ``loop_step_s`` ratio <= 1.01, expected within the A/A noise.

    python benchmarks/flight_recorder_overhead.py [--pairs N] [--budget-s S] [--steps N] [key=value ...]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from comm_callback_overhead import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["--arms", "recorder", *sys.argv[1:]]))
