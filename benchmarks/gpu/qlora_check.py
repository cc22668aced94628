"""gpu_check.sh's QLoRA step (peft.method: qlora): LoRA adapters on a base loaded in 4 bits with bitsandbytes,
which only a GPU runs. The base must be a pretrained checkpoint (the 4-bit load quantizes saved weights): the
default recipe's tiny Llama, saved to BASE_DIR first. The check: the run finishes its 10 steps and exports its
adapter.

    python3 benchmarks/gpu/qlora_check.py BASE_DIR SUMMARY_JSON RECIPE [override ...]

(the overrides name BASE_DIR as model.name_or_path and trainer.max_steps=10.)
"""

import json
import subprocess
import sys


def main() -> int:
    base_dir, summary_json, recipe, overrides = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
    from transformers import AutoModelForCausalLM

    from shardlight.build import build_hf_config
    from shardlight.recipe import load_recipe

    AutoModelForCausalLM.from_config(build_hf_config(load_recipe(None, []).model)).save_pretrained(base_dir)
    rc = subprocess.call([sys.executable, "-m", "shardlight.cli", "train", recipe, *overrides,
                          "--summary-json", summary_json])
    if rc != 0:
        print(f"QLORA FAILED: shardlight train exited {rc}")
        return 1
    summary = json.load(open(summary_json))
    if summary.get("steps") != 10 or not summary.get("model_dir"):
        print(f"QLORA FAILED: {summary}")
        return 1
    print("QLORA OK", summary["model_dir"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
