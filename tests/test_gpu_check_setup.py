"""benchmarks/gpu_check.sh, the GPU machine's check, as far as a CPU machine can take it: its scripts parse, the
peer comparison refuses cleanly without CUDA, and, where the carried wheels were fetched (.whl/, git-ignored,
by benchmarks/gpu/fetch_wheels.sh), the rehearsal's set-up check passes: the wheels install into a temporary
target, wandb/omegaconf/datasets import from there (with a python 3.12, the wheels' own: GPU_CHECK_PYTHON),
shardlight imports from the laid-out tree and the GPU steps' recipes load."""

import os
import py_compile
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = [REPO / "benchmarks" / "gpu_check.sh", REPO / "benchmarks" / "gpu" / "fetch_wheels.sh"]
needs_bash = pytest.mark.skipif(shutil.which("bash") is None, reason="no bash on this machine")


@needs_bash
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_parses(script):
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("script", sorted((REPO / "benchmarks" / "gpu").glob("*.py")), ids=lambda p: p.name)
def test_gpu_python_compiles(script, tmp_path):
    py_compile.compile(str(script), cfile=str(tmp_path / "out.pyc"), doraise=True)


@needs_bash
def test_usage_error():
    result = subprocess.run(["bash", str(SCRIPTS[0])], capture_output=True, text=True)
    assert result.returncode == 2 and "usage:" in result.stderr


def test_peer_compare_refuses_without_cuda():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: peer_compare.py would run")
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu" / "peer_compare.py"), "--steps", "5"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs a CUDA GPU" in lines[0], result.stderr


@needs_bash
def test_rehearsal_setup_check(tmp_path):
    wheels = sorted((REPO / ".whl").glob("*.whl"))
    if not wheels:
        pytest.skip("no .whl/ here: run benchmarks/gpu/fetch_wheels.sh (pip must reach a registry) to rehearse")
    env = dict(os.environ, GPU_CHECK_PYTHON=os.environ.get("GPU_CHECK_PYTHON", sys.executable),
               GPU_CHECK_TORCH_PYTHON=sys.executable, GPU_CHECK_SITE=str(tmp_path / "site"))
    result = subprocess.run(["bash", str(SCRIPTS[0]), "--rehearse", str(tmp_path / "out")], env=env, cwd=REPO,
                            capture_output=True, text=True, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "REHEARSAL OK" in output and output.count("SETUP OK") >= 1, output[-4000:]
    assert "SETUP FAILED" not in output, output[-4000:]
    assert (tmp_path / "out" / "gpu_check.log").read_text().strip()
