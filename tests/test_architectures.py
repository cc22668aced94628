"""Any Hugging Face decoder: every causal-LM architecture of the installed transformers with
``_no_split_modules`` (tests/architectures.py, from its auto mappings) is either refused by preflight's model
checks in one line that names a recipe key, or trains 4 steps on 2 gloo ranks on FSDP1 and on FSDP2 with
finite losses, both starting from the same loss. Preflight never accepts a model the ranks then fail on.
The README lists the families that train."""

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
from architectures import families

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "workers" / "architecture_matrix.py"
MIN_TRAINED = 13  # Llama and at least a dozen families beyond it
README_LIST = re.compile(r"<!-- families -->\n(.*?)\n<!-- /families -->", re.S)


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    """(refusals {family: line}, training results {family: {fsdp1, fsdp2} or {error}}): one 2-rank job."""
    out = tmp_path_factory.mktemp("architectures") / "results.json"
    result = subprocess.run([sys.executable, str(WORKER), str(out), "29631"],
                            capture_output=True, text=True, timeout=600, cwd=REPO)
    assert result.returncode == 0, result.stderr[-4000:]
    results = json.loads(out.read_text())
    return results["refused"], results["trained"]


@pytest.mark.slow
def test_every_architecture_trains_or_is_refused_in_one_line(matrix):
    refused, trained = matrix
    assert set(refused) | set(trained) == set(families())
    for family, line in refused.items():
        assert "\n" not in line and re.match(r"^[a-z_.]+[ :]", line), (family, line)
    failed = {family: result for family, result in trained.items() if "error" in result}
    assert not failed, f"preflight accepted these, the ranks failed: {json.dumps(failed, indent=1)[:6000]}"
    for family, result in trained.items():
        for version in ("fsdp1", "fsdp2"):
            assert len(result[version]) == 4 and all(map(math.isfinite, result[version])), (family, result)
        # Same seed, same batch, no dropout: both strategies compute the same first loss.
        assert result["fsdp1"][0] == pytest.approx(result["fsdp2"][0], rel=1e-4), (family, result)
    assert len(trained) >= MIN_TRAINED and "llama" in trained, sorted(trained)


@pytest.mark.slow
def test_readme_lists_the_families_that_train(matrix):
    _, trained = matrix
    listed = README_LIST.search((REPO / "README.md").read_text()).group(1)
    assert sorted(re.findall(r"`([^`]+)`", listed)) == sorted(trained), (
        "README's families: " + ", ".join(f"`{name}`" for name in sorted(trained)))
