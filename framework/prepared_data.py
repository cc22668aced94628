"""Tokenized, packed data made once and read by every rank and every restart: a cache entry per input.

The key is the data's content (each local file's bytes, or a hub dataset's own ``datasets`` fingerprint), the
tokenizer (its whole definition, special tokens and chat template), the data settings and the seed (the
validation hold-out and the mixture draw depend on it). One process builds an entry while the others wait on a
file lock, then they all read it: once per node with a node-local ``data.cache_dir``, once per cluster on a
shared file system. An entry is a directory of ``.npy`` arrays made under a temporary name and renamed into
place when complete, so a crash mid-build leaves nothing that could be read. Readers map the arrays
copy-on-write, so the ranks of a node share one copy in the page cache.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import numpy as np

from shardlight.errors import ShardlightError, first_line
from shardlight.recipe import RecipeConfig

# Bumped whenever what an entry holds changes meaning (the block layout, the encoder), so old entries are not read.
LAYOUT_VERSION = 1
# Settings that change nothing in the entry.
_NOT_IN_KEY = ("num_workers", "cache_dir")

Splits = Dict[str, Dict[str, np.ndarray]]  # split name ("train", "val", "val/<source>") → arrays


def cache_root(cfg: RecipeConfig) -> Path:
    """``data.cache_dir``, else ``$XDG_CACHE_HOME/shardlight/data`` (``~/.cache/shardlight/data``), as
    Hugging Face's caches sit under ``~/.cache``."""
    if cfg.data.cache_dir:
        return Path(cfg.data.cache_dir).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "shardlight" / "data"


def file_digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "blake2b").hexdigest()


def tokenizer_digest(tokenizer) -> str:
    """Everything of a tokenizer that decides the ids: its definition (vocabulary, merges, normalizer, added
    tokens), its special tokens and its chat template."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    definition = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    parts = [type(tokenizer).__name__, definition, json.dumps(tokenizer.special_tokens_map, sort_keys=True,
                                                              default=str),
             json.dumps(getattr(tokenizer, "chat_template", None), sort_keys=True)]
    return hashlib.blake2b("\0".join(parts).encode()).hexdigest()


def entry_key(cfg: RecipeConfig, tokenizer, data_digests: List[str]) -> str:
    settings = {k: v for k, v in dataclasses.asdict(cfg.data).items() if k not in _NOT_IN_KEY}
    for key in ("train_files", "val_files"):
        settings.pop(key, None)  # the files' content is in data_digests; where they lie does not matter
    text = json.dumps({"layout": LAYOUT_VERSION, "seed": cfg.trainer.seed, "settings": settings,
                       "data": data_digests, "tokenizer": tokenizer_digest(tokenizer)}, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def _read(entry: Path) -> Tuple[Splits, dict]:
    meta = json.loads((entry / "meta.json").read_text())
    splits = {split: {name: _load(entry / f"{file}.{name}.npy") for name in names}
              for split, (file, names) in meta["splits"].items()}
    return splits, meta["stats"]


def _load(path: Path) -> np.ndarray:
    try:
        return np.load(path, mmap_mode="c")
    except ValueError:  # an empty array cannot be mapped
        return np.load(path)


def _write(entry: Path, splits: Splits, stats: dict) -> None:
    staging = entry.with_name(f".{entry.name}.{os.getpid()}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    layout = {}
    for i, (split, arrays) in enumerate(splits.items()):
        layout[split] = (f"split{i}", sorted(arrays))
        for name, array in arrays.items():
            np.save(staging / f"split{i}.{name}.npy", array)
    (staging / "meta.json").write_text(json.dumps({"splits": layout, "stats": stats}, indent=1))
    os.rename(staging, entry)  # atomic: an entry is complete or absent


def load_or_build(root: Path, key: str, build: Callable[[], Tuple[Splits, dict]]) -> Tuple[Splits, dict, str]:
    """The entry ``key`` under ``root``: read it, or (first process to get the lock) build and write it.
    Returns (splits, stats, the console line that says which happened)."""
    from filelock import FileLock

    entry = root / key
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ShardlightError(f"data.cache_dir '{root}' cannot be created: {exc.strerror or first_line(exc)}") from None
    with FileLock(str(root / f".{key}.lock")):
        if (entry / "meta.json").is_file():
            splits, stats = _read(entry)
            return splits, stats, f"shardlight: data read from the cache ({_counts(stats)}): {entry}"
        start = time.perf_counter()
        splits, stats = build()
        _write(entry, splits, stats)
        took = time.perf_counter() - start
    return (_read(entry)[0], stats,
            f"shardlight: data tokenized in {took:.1f} s ({_counts(stats)}), cached for restarts and the other "
            f"ranks: {entry}")


def _counts(stats: dict) -> str:
    return (f"{stats['train_examples']} training examples in {stats['train_sequences']} sequences, "
            f"{stats['val_examples']} validation examples in {stats['val_sequences']}")
