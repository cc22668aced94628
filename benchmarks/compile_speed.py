"""``compile: true`` (``torch.compile`` on each transformer block) against eager on the default recipe, 2 gloo
ranks: the step-time ratio (tokens/s is its inverse) with its 90% interval and A/A noise. The runs and their
metrics are ``comm_callback_overhead.py``'s (``--arms compile``: the comm callback off in both arms; the first
``WARMUP`` steps, where the compile happens, are outside the measured loop). A figure, not a target: CPU inductor
says little about a GPU.

    python benchmarks/compile_speed.py [--pairs N] [--budget-s S] [--steps N] [key=value ...]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from comm_callback_overhead import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["--arms", "compile", *sys.argv[1:]]))
