"""Writing result files: one JSON writer for every report, summary and listing shardlight produces."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Union

from shardlight.errors import ShardlightError


def write_json(path: Union[str, Path], data: Any) -> None:
    """``data`` as indented JSON (anything else as its ``str``), parent dirs made; an unwritable path is one
    clear error naming it."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    except OSError as exc:
        raise ShardlightError(f"cannot write {path}: {exc.strerror or exc}") from None
