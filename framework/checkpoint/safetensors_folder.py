"""A Hugging Face safetensors folder written from the shards, and checked against them, without any process
holding the whole model (issue 35: a 70B export must not gather 280 GB into rank 0).

- ``shard_plan``: which output file each tensor goes to (Hugging Face's ``max_shard_size`` rule, from global
  shapes, so every rank computes the same plan).
- ``refuse_nonfinite``: one error naming the first weight with a NaN or inf, on every rank, before anything
  is written (each rank counts its shards; one all-reduce).
- ``write_safetensors_folder``: every rank writes its slices (DCP's ``HuggingFaceStorageWriter``, distributed),
  then the ranks assemble the output files between them, one tensor at a time (torch's
  ``consolidate_safetensors_files_on_every_rank``); the index is written, the slices removed.
- ``verify_safetensors_folder``: every rank reads its slices back from the written files (DCP's
  ``HuggingFaceStorageReader``) a few hundred MB at a time and compares them with its shards exactly; the
  largest difference over all ranks is returned.
- ``write_file_by_file`` (one process, no ranks: ``shardlight export``): one output file at a time, its
  tensors made by the caller (read from a checkpoint, merged), written, read back and compared exactly;
  ``staged_folder``: the folder is assembled beside its destination and moved in only when all of it verified.

``state`` is the HF model's state dict as its ranks hold it: ``DTensor`` (FSDP2, TP, FSDP1 with a mesh),
``ShardedTensor`` (FSDP1) or plain tensors (replicated), under the HF model's own names.
"""

from __future__ import annotations

import contextlib
import math
import shutil
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Mapping, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from shardlight.errors import ShardlightError
from shardlight.files import write_json

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
PARTIAL_SUFFIX = ".partial"  # an export being written, beside its folder; moved in when verified
SLICES_DIR = ".slices"  # each rank's slices while the files are assembled; removed after
VERIFY_BATCH_BYTES = 256 * 2**20  # of global tensor bytes per read-back (per rank: its share of that)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def tensor_bytes(tensor: torch.Tensor) -> int:
    return math.prod(tensor.size()) * tensor.dtype.itemsize


def _empty_like(tensor: torch.Tensor) -> torch.Tensor:
    """Storage for ``tensor``'s slices on this rank, sharded alike (``empty_like`` knows no ShardedTensor)."""
    if hasattr(tensor, "local_shards"):
        from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor

        shards = [Shard(torch.empty_like(s.tensor), s.metadata) for s in tensor.local_shards()]
        return ShardedTensor._init_from_local_shards_and_global_metadata(shards, tensor.metadata())
    return torch.empty_like(tensor)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    if hasattr(tensor, "to_local"):  # DTensor
        return tensor.to_local()
    if hasattr(tensor, "local_shards"):  # ShardedTensor: FSDP1 keeps one shard per rank
        shards = tensor.local_shards()
        return shards[0].tensor if shards else torch.empty(0, dtype=tensor.dtype)
    return tensor


def shard_plan(state: Mapping[str, torch.Tensor], max_shard_bytes: int) -> Dict[str, int]:
    """Tensor name → output file index (1..N), in ``state``'s order: a file is closed once the next tensor
    would take it past ``max_shard_bytes`` (a larger tensor gets a file of its own), as ``save_pretrained``."""
    plan: Dict[str, int] = {}
    index, used = 1, 0
    for name, tensor in state.items():
        size = tensor_bytes(tensor)
        if used and used + size > max_shard_bytes:
            index, used = index + 1, 0
        plan[name] = index
        used += size
    return plan


def refuse_nonfinite(state: Mapping[str, torch.Tensor], across_ranks: bool = True) -> None:
    """A model with a NaN or inf weight is broken, however well it reloads: one error naming the first such
    weight and how many values it has, before anything is written. ``across_ranks``: every rank calls it with
    its shards and all raise alike (one all-reduce); else ``state`` is whole, in one process."""
    names = [n for n, t in state.items() if torch.is_tensor(t) and t.dtype.is_floating_point]
    counts = torch.tensor([0 if _local(state[n]).is_meta else int((~torch.isfinite(_local(state[n]))).sum())
                           for n in names], dtype=torch.long)
    if across_ranks and _distributed() and names:
        dist.all_reduce(counts)
    for name, count in zip(names, counts.tolist()):
        if count:
            raise ShardlightError(f"refusing to export non-finite weights: {name} has {count} non-finite "
                                  f"values; nothing written")


def write_safetensors_folder(state: Mapping[str, torch.Tensor], out_dir: Path, max_shard_bytes: int) -> None:
    """Write ``state`` as safetensors files + index in ``out_dir`` (every rank calls it); a model that fits
    one file is ``model.safetensors``, without an index, as ``save_pretrained`` writes it."""
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files_on_every_rank

    out_dir = Path(out_dir)
    slices = out_dir / SLICES_DIR
    rank = dist.get_rank() if _distributed() else 0
    if rank == 0:
        shutil.rmtree(slices, ignore_errors=True)
        slices.mkdir(parents=True)
    if _distributed():
        dist.barrier()
    plan = shard_plan(state, max_shard_bytes)
    dcp.save(dict(state), no_dist=not _distributed(), storage_writer=HuggingFaceStorageWriter(
        str(slices), fqn_to_index_mapping=plan, save_distributed=True))
    consolidate_safetensors_files_on_every_rank(str(slices), str(out_dir), plan)  # ends with a barrier
    if rank == 0:
        shutil.rmtree(slices)
        if max(plan.values()) == 1:
            (out_dir / "model-00001-of-00001.safetensors").replace(out_dir / SINGLE_FILE)
            (out_dir / INDEX_FILE).unlink()
    if _distributed():
        dist.barrier()


def verify_safetensors_folder(state: Mapping[str, torch.Tensor], out_dir: Path) -> float:
    """The largest |difference| between ``state`` and the files in ``out_dir`` (every rank calls it and gets
    the maximum over all ranks): each rank reads back its own slices, ``VERIFY_BATCH_BYTES`` of the model at
    a time."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    worst = torch.zeros(())
    batch: Dict[str, torch.Tensor] = {}
    names = list(state)
    for i, name in enumerate(names):
        batch[name] = state[name]
        if i + 1 < len(names) and sum(tensor_bytes(t) for t in batch.values()) < VERIFY_BATCH_BYTES:
            continue
        read = {n: _empty_like(t) for n, t in batch.items()}
        dcp.load(read, no_dist=not _distributed(), storage_reader=HuggingFaceStorageReader(str(out_dir)))
        for n, t in batch.items():
            mine, theirs = _local(t).float(), _local(read[n]).float()
            if mine.numel():
                worst = torch.maximum(worst, (mine - theirs).abs().max())
        batch.clear()
    if _distributed():
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst)


def write_file_by_file(out_dir: Path, shapes: Mapping[str, torch.Tensor],
                       make: Callable[[List[str]], Dict[str, torch.Tensor]], max_shard_bytes: int) -> Tuple[int, float]:
    """Write the tensors named in ``shapes`` (meta tensors: shape and dtype, in file order) to ``out_dir`` as
    ``save_pretrained`` would, one output file at a time: ``make(names)`` gives one file's tensors, which are
    refused if non-finite, written, read back and compared exactly before the next file is made, so the
    process holds one file of at most ``max_shard_bytes``. Returns (files written, largest |difference|)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    Path(out_dir).mkdir(parents=True, exist_ok=True)
    plan = shard_plan(shapes, max_shard_bytes)
    count = max(plan.values())
    weight_map: Dict[str, str] = {}
    worst = 0.0
    for index in range(1, count + 1):
        part = make([n for n in shapes if plan[n] == index])
        refuse_nonfinite(part, across_ranks=False)
        file = SINGLE_FILE if count == 1 else f"model-{index:05d}-of-{count:05d}.safetensors"
        save_file(part, str(Path(out_dir) / file), metadata={"format": "pt"})
        with safe_open(str(Path(out_dir) / file), framework="pt") as f:
            for n, t in part.items():
                if t.numel():
                    worst = max(worst, float((f.get_tensor(n).float() - t.float()).abs().max()))
        weight_map.update(dict.fromkeys(part, file))
        del part
    if count > 1:
        total = sum(tensor_bytes(t) for t in shapes.values())
        write_json(Path(out_dir) / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map})
    return count, worst


@contextlib.contextmanager
def staged_folder(out_dir: Path) -> Iterator[Path]:
    """A folder to write ``out_dir``'s contents into, beside it (``OUT.partial``): moved into ``out_dir`` (entry
    by entry, replacing what is there) when the block ends, removed when it raises, so a failed or interrupted
    export never leaves half a model where a whole one is expected."""
    out_dir = Path(out_dir)
    partial = out_dir.with_name(out_dir.name + PARTIAL_SUFFIX)
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        yield partial
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    out_dir.mkdir(parents=True, exist_ok=True)
    for entry in partial.iterdir():
        if (out_dir / entry.name).is_dir():
            shutil.rmtree(out_dir / entry.name)
        entry.replace(out_dir / entry.name)
    partial.rmdir()
