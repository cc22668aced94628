#!/usr/bin/env bash
# Downloads into .whl/ (git-ignored) the wheels that benchmarks/gpu_check.sh needs on the lent GPU machine
# (`nvidia-h200`: python3 3.12 with torch 2.11, lightning, transformers, accelerate, peft, ... and no network):
# shardlight's requirements that the machine lacks (wandb, omegaconf, datasets), their own requirements that it
# lacks, and bitsandbytes for the QLoRA step. One version of each; nothing that the machine already holds.
#
#   benchmarks/gpu/fetch_wheels.sh            # run here, where pip reaches a registry: 23 wheels, 31 MiB
#
# The machine's package names are the list in /work/.library/device/KINDS.md ("Python packages already
# there", read 2026-11-17), copied below. A requirement of a carried wheel is followed (and its wheel carried)
# only when that name is not on the list. bitsandbytes' wheel is slimmed to its CPU and CUDA 13 libraries (it
# ships one ~22 MB library per CUDA/ROCm version; the machine's torch is 2.11+cu130): set BNB_FULL=1 to keep
# all of them. Versions: the ones this project's .venv was tested with (override with WANDB=, OMEGACONF=,
# DATASETS=, BITSANDBYTES=). omegaconf 2.4 vendors its ANTLR parser, so antlr4-python3-runtime is not needed;
# with OMEGACONF=2.3.0 it is followed as omegaconf's requirement.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DEST="${WHEEL_DIR:-$REPO/.whl}"
PIP_PY="${PIP_PYTHON:-python3}"
TOPS=("wandb==${WANDB:-0.31.0}" "omegaconf==${OMEGACONF:-2.4.0}" "datasets==${DATASETS:-5.2.0}")
# Its requirements (torch, numpy, packaging) are all on the machine: downloaded alone, or pip would fetch torch.
BNB="bitsandbytes==${BITSANDBYTES:-0.50.2}"
PLATFORM=(--only-binary=:all: --python-version 3.12 --implementation cp
          --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
          --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)

# KINDS.md, nvidia-h200, "Python packages already there".
MACHINE_PACKAGES="absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch
build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin
jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite
lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas
nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand
nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink
nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum
opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker
prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks
pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn
scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers
statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope
triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl
zipp"

ALL="$(mktemp -d)"
trap 'rm -rf "$ALL"' EXIT
# With dependencies, resolved for the machine's interpreter and platform: one consistent version of each.
"$PIP_PY" -m pip download -q "${PLATFORM[@]}" -d "$ALL" "${TOPS[@]}"
"$PIP_PY" -m pip download -q --no-deps "${PLATFORM[@]}" -d "$ALL" "$BNB"

rm -rf "$DEST" && mkdir -p "$DEST"
MACHINE_PACKAGES="$MACHINE_PACKAGES" BNB_FULL="${BNB_FULL:-0}" "$PIP_PY" - "$ALL" "$DEST" "${TOPS[@]}" "$BNB" <<'EOF'
"""Copy the closure of the top requirements, stopping at the machine's packages, from ALL to DEST."""
import base64
import hashlib
import os
import re
import shutil
import sys
import zipfile
from email.parser import HeaderParser
from pathlib import Path

from pip._vendor.packaging.requirements import Requirement

src, dest, tops = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()  # noqa: E731
machine = {norm(n) for n in os.environ["MACHINE_PACKAGES"].split()}
# The machine: CPython 3.12 on x86-64 Linux.
env = {"python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
       "platform_python_implementation": "CPython", "sys_platform": "linux", "platform_system": "Linux",
       "platform_machine": "x86_64", "os_name": "posix", "extra": ""}

wheels = {}
for path in sorted(src.glob("*.whl")):
    with zipfile.ZipFile(path) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        headers = HeaderParser().parsestr(zf.read(meta).decode())
    wheels[norm(headers["Name"])] = (path, headers.get_all("Requires-Dist") or [])

todo, keep = [norm(Requirement(t).name) for t in tops], {}
while todo:
    name = todo.pop()
    if name in keep or name in machine:
        continue
    if name not in wheels:
        sys.exit(f"fetch_wheels: no wheel was downloaded for {name}")
    keep[name] = wheels[name][0]
    for line in wheels[name][1]:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate(env):
            todo.append(norm(req.name))


def slim_bitsandbytes(path: Path, out: Path) -> None:
    """The wheel without the native libraries of other CUDA/ROCm/XPU versions; RECORD rewritten to match."""
    drop = re.compile(r"bitsandbytes/libbitsandbytes_(cuda(?!13)\d+|rocm\d+|xpu\d+)\.so$")
    with zipfile.ZipFile(path) as zin, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zout:
        names = [n for n in zin.namelist() if not drop.search(n)]
        record = next(n for n in names if n.endswith(".dist-info/RECORD"))
        rows = []
        for name in names:
            if name == record:
                continue
            data = zin.read(name)
            zout.writestr(zin.getinfo(name), data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            rows.append(f"{name},sha256={digest},{len(data)}")
        zout.writestr(record, "\n".join(rows + [f"{record},,"]) + "\n")


for name, path in sorted(keep.items()):
    if name == "bitsandbytes" and os.environ.get("BNB_FULL") != "1":
        slim_bitsandbytes(path, dest / path.name)
    else:
        shutil.copy(path, dest / path.name)
    print(f"  {path.name}")
skipped = sorted(n for n in wheels if n not in keep)
print(f"fetch_wheels: {len(keep)} wheels into {dest}; not carried (on the machine, or only required by what is): "
      f"{', '.join(skipped)}")
EOF
du -sh "$DEST"
