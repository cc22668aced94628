"""``shardlight inspect``: what a checkpoint holds, from DCP's ``.metadata`` only (no weights are loaded).

Per tensor: name, full shape, dtype, bytes and the slice each rank's file holds; totals for the model
weights and for the rest (optimizer state).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional, TypedDict

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from shardlight.checkpoint.store import META, WEIGHT_PREFIX, checkpoint_in, read_dcp_metadata, verify_metadata_file
from shardlight.errors import ShardlightError


class Shard(TypedDict):
    rank: Optional[int]
    file: str
    slices: List[List[int]]  # [start, stop) per dimension


class Entry(TypedDict):
    name: str  # the HF parameter name for model weights, the DCP key otherwise
    shape: List[int]
    dtype: str
    bytes: int
    shards: List[Shard]


class Listing(TypedDict):
    checkpoint: str
    ranks: List[int]
    entries: List[Entry]
    model_bytes: int
    other_bytes: int
    total_bytes: int
    mesh: Optional[Dict[str, int]]  # the (dp_replicate, dp_shard, tp) mesh it was saved on, with TP


def _rank_of(file_name: str) -> Optional[int]:
    if file_name.startswith("__"):
        head = file_name[2:].split("_", 1)[0]
        return int(head) if head.isdigit() else None
    return None


def inspect_checkpoint(path: Path, include_optimizer: bool = False) -> Listing:
    """A checkpoint (or a run dir: its newest) → its listing; optimizer state is counted, and listed only
    with ``include_optimizer``. ``.metadata`` is checked against its recorded hash before it is unpickled."""
    path = Path(path)
    if not path.exists():
        raise ShardlightError(f"checkpoint {path} does not exist")
    checkpoint = checkpoint_in(path) or path
    verify_metadata_file(checkpoint)
    metadata = read_dcp_metadata(checkpoint)
    layout: Dict[str, List[Dict[str, Any]]] = {}
    for index, info in (metadata.storage_data or {}).items():
        layout.setdefault(index.fqn, []).append(
            {"rank": _rank_of(info.relative_path), "file": info.relative_path,
             "offsets": list(index.offset) if index.offset is not None else None})
    entries: List[Entry] = []
    totals = {"model_bytes": 0, "other_bytes": 0}
    for fqn, meta in sorted(metadata.state_dict_metadata.items()):
        if not isinstance(meta, TensorStorageMetadata):
            continue
        is_weight = fqn.startswith(WEIGHT_PREFIX)
        numel = 1
        for d in meta.size:
            numel *= d
        nbytes = numel * torch.empty((), dtype=meta.properties.dtype).element_size()
        totals["model_bytes" if is_weight else "other_bytes"] += nbytes
        if not (is_weight or include_optimizer):
            continue
        sizes = {tuple(c.offsets): list(c.sizes) for c in meta.chunks}
        shards: List[Shard] = []
        for part in sorted(layout.get(fqn, []), key=lambda p: (p["rank"] is None, p["rank"], p["offsets"])):
            offsets = part["offsets"] or [0] * len(meta.size)
            size = sizes.get(tuple(offsets), list(meta.size))
            shards.append({"rank": part["rank"], "file": part["file"],
                           "slices": [[o, o + s] for o, s in zip(offsets, size)]})
        entries.append({"name": fqn[len(WEIGHT_PREFIX):] if is_weight else fqn, "shape": list(meta.size),
                        "dtype": str(meta.properties.dtype).replace("torch.", ""), "bytes": nbytes, "shards": shards})
    ranks = sorted({r for parts in layout.values() for r in (p["rank"] for p in parts) if r is not None})
    meta_file = checkpoint / META
    mesh = json.loads(meta_file.read_text()).get("mesh") if meta_file.is_file() else None
    return {"checkpoint": str(checkpoint), "ranks": ranks, "entries": entries, **totals,
            "total_bytes": totals["model_bytes"] + totals["other_bytes"], "mesh": mesh}


def format_inspect(listing: Listing) -> str:
    """The listing as the table ``shardlight inspect`` prints."""
    lines = [f"{listing['checkpoint']}: {len(listing['ranks'])} rank(s) wrote shards"]
    if listing.get("mesh"):
        lines[0] += "; mesh " + " x ".join(f"{name} {size}" for name, size in listing["mesh"].items())
    for e in listing["entries"]:
        layout = "  ".join(f"r{s['rank']}:" + ",".join(f"{a}:{b}" for a, b in s["slices"]) for s in e["shards"])
        lines.append(f"{e['name']:<60} {str(tuple(e['shape'])):<16} {e['dtype']:<9} {e['bytes']:>12,d} B  {layout}")
    lines.append(f"model weights: {listing['model_bytes']:,d} bytes; optimizer and other state: "
                 f"{listing['other_bytes']:,d} bytes; total {listing['total_bytes']:,d} bytes")
    return "\n".join(lines)
