"""Cost of weighing every token the same (``docs/strategy.md``, "One step's loss"): one all-reduce of the step's
token count and one scaling of the gradients per optimizer step, on and off, on the default recipe, 2 gloo ranks.
The runs and their metrics are ``comm_callback_overhead.py``'s (``--arms token-mean``: the comm callback off in
both arms); target ``loop_step_s`` ratio <= 1.01.

    python benchmarks/token_weighting_overhead.py [--pairs N] [--budget-s S] [--steps N] [key=value ...]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from comm_callback_overhead import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["--arms", "token-mean", *sys.argv[1:]]))
