"""Data files: which local files a recipe means (globs, formats), the preflight checks on them (every row has
its fields, file:line on the first that does not), and loading local files or a hub dataset with ``datasets``.

``datasets`` is imported only where a file is loaded: preflight must stay quick.
"""

from __future__ import annotations

import csv
import glob
import json
import os
import tempfile
from pathlib import Path
from typing import Any, List

from shardlight.errors import ShardlightError, first_line
from shardlight.recipe import RecipeConfig, SourceConfig

BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}


def _required(d: SourceConfig) -> List[str]:
    return {"instruction": [d.prompt_field, d.response_field], "text": [d.text_field],
            "chat": [d.messages_field]}[d.format]


def expand_files(files: List[str], key: str) -> List[str]:
    out: List[str] = []
    for pattern in (os.path.expanduser(f) for f in files):
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        if not matches:
            raise ShardlightError(f"no data files match {pattern} ({key})")
        out.extend(matches)
    return out


def _builder(files: List[str], key: str) -> str:
    builders = set()
    for path in files:
        ext = Path(path).suffix.lower()
        if ext not in BUILDERS:
            raise ShardlightError(f"{path}: unsupported data file type '{ext or '(none)'}'; "
                                  f"allowed: {', '.join(BUILDERS)}")
        builders.add(BUILDERS[ext])
    if len(builders) > 1:
        raise ShardlightError(f"{key} mixes file types ({', '.join(sorted(builders))}); use one type per list")
    return builders.pop()


def _check_row(row: Any, d: SourceConfig, where: str) -> None:
    if not isinstance(row, dict):
        raise ShardlightError(f"{where}: row is not a JSON object (got {type(row).__name__})")
    required = _required(d)
    for name in required:
        if name not in row:
            raise ShardlightError(f"{where}: row is missing field '{name}' "
                                  f"(format: {d.format} needs {', '.join(required)})")
    if d.format == "chat":
        messages = row[d.messages_field]
        if not isinstance(messages, list) or not messages:
            raise ShardlightError(f"{where}: field '{d.messages_field}' must be a non-empty list of "
                                  "{role, content} objects")
        for j, msg in enumerate(messages):
            bad = [k for k in ("role", "content") if not isinstance(msg, dict) or not isinstance(msg.get(k), str)]
            if bad:
                raise ShardlightError(f"{where}: message {j} in '{d.messages_field}' needs a string '{bad[-1]}'")
        return
    for name in required:
        if not isinstance(row[name], str):
            got = "null" if row[name] is None else type(row[name]).__name__
            raise ShardlightError(f"{where}: field '{name}' must be a string, got {got}")


# Text files are read as UTF-8 with an optional byte-order mark (as Windows tools write them); ``datasets``'
# json and csv loaders skip a BOM themselves, its text loader is told to (``_LOAD_OPTIONS``).
TEXT_ENCODING = "utf-8-sig"
_LOAD_OPTIONS = {"text": {"encoding": TEXT_ENCODING}}


def _check_json(path: str, d: SourceConfig) -> None:
    try:
        text = Path(path).read_text(encoding=TEXT_ENCODING)
    except UnicodeDecodeError as exc:
        raise ShardlightError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    if not text.strip():
        raise ShardlightError(f"data file is empty: {path}")
    if text.lstrip().startswith("["):  # one JSON array of rows
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ShardlightError(f"{path}:{exc.lineno}: invalid JSON: {exc.msg} (column {exc.colno})") from None
        if not rows:
            raise ShardlightError(f"data file is empty: {path}")
        for i, row in enumerate(rows, 1):
            _check_row(row, d, f"{path}: row {i}")
        return
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ShardlightError(f"{path}:{lineno}: invalid JSON: {exc.msg} (column {exc.colno})") from None
        _check_row(row, d, f"{path}:{lineno}")


def check_columns(columns: List[str], d: SourceConfig, source: str) -> None:
    required = _required(d)
    for name in required:
        if name not in columns:
            raise ShardlightError(f"{source}: missing column '{name}' (format: {d.format} needs "
                                  f"{', '.join(required)}); columns: {', '.join(columns) or '(none)'}")


def _check_file(path: str, builder: str, d: SourceConfig) -> None:
    if not os.path.isfile(path):
        raise ShardlightError(f"data file not found: {path}")
    if os.path.getsize(path) == 0:
        raise ShardlightError(f"data file is empty: {path}")
    if builder == "json":
        _check_json(path, d)
    elif builder == "csv":
        if d.format == "chat":
            raise ShardlightError(f"{path}: format chat needs a list column '{d.messages_field}'; use JSONL or Parquet")
        with open(path, newline="", encoding=TEXT_ENCODING, errors="replace") as f:
            reader = csv.reader(f)
            header = next(reader, None)
            if not header or next(reader, None) is None:
                raise ShardlightError(f"data file is empty: {path}")
        check_columns(header, d, path)
    elif builder == "parquet":
        import pyarrow.parquet as pq
        try:
            meta = pq.ParquetFile(path)
        except Exception as exc:
            raise ShardlightError(f"{path}: not a readable Parquet file ({first_line(exc)})") from None
        if meta.metadata.num_rows == 0:
            raise ShardlightError(f"data file is empty: {path}")
        check_columns(meta.schema_arrow.names, d, path)
    else:  # text: one row per line, column "text"
        if d.format != "text":
            raise ShardlightError(f"{path}: .txt files give one text row per line; they need data.format: text")
        with open(path, encoding=TEXT_ENCODING, errors="replace") as f:
            if not any(line.strip() for line in f):
                raise ShardlightError(f"data file is empty: {path}")


def check_data(cfg: RecipeConfig) -> None:
    """Preflight on local data files, each dataset of a mixture too (hub datasets are not checked: no network
    here)."""
    for _, prefix, d in cfg.data.sources():
        if d.format == "instruction":
            try:
                d.prompt_template.format(prompt="x")
            except (KeyError, IndexError, ValueError) as exc:
                raise ShardlightError(f"{prefix}.prompt_template cannot be filled ({type(exc).__name__}: {exc}); "
                                      "only {prompt} is substituted, write literal braces as {{ and }}") from None
        for key, files in ((f"{prefix}.train_files", d.train_files), (f"{prefix}.val_files", d.val_files)):
            if not files:
                continue
            paths = expand_files(list(files), key)
            builder = _builder(paths, key)
            for path in paths:
                _check_file(path, builder, d)


def load_local(files: List[str], d: SourceConfig, key: str):
    import datasets

    paths = expand_files(list(files), key)
    builder = _builder(paths, key)
    cache = os.path.join(tempfile.gettempdir(), "shardlight-datasets-cache")
    try:
        ds = datasets.load_dataset(builder, data_files=paths, split="train", cache_dir=cache, keep_in_memory=True,
                                   **_LOAD_OPTIONS.get(builder, {}))
    except Exception as exc:
        raise ShardlightError(f"could not load {key} ({', '.join(paths)}): {first_line(exc)}") from None
    if builder == "text" and d.text_field != "text":
        ds = ds.rename_column("text", d.text_field)
    return ds


def load_hub(d: SourceConfig, split: str):
    import datasets

    try:
        # Memory-mapped from datasets' own cache: every rank may open it, to fingerprint it.
        return datasets.load_dataset(d.dataset, d.dataset_config, split=split)
    except Exception as exc:
        cfg_part = f", config '{d.dataset_config}'" if d.dataset_config else ""
        raise ShardlightError(f"could not load hub dataset '{d.dataset}'{cfg_part}, split '{split}': "
                              f"{first_line(exc)} (offline? download it first or use data.train_files)") from None
