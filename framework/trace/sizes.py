"""Message sizes and bus-bandwidth factors of collectives, in nccl-tests' conventions.

nccl-tests reports one "size" per collective, and bus bandwidth as ``algbw * factor`` with the
factor that makes it comparable to a link's peak whatever the collective (n = group size):

* all_reduce: size = the buffer, factor ``2(n-1)/n``;
* all_gather: size = the total output (input x n), factor ``(n-1)/n``;
* reduce_scatter: size = the total input, factor ``(n-1)/n``;
* anything else (broadcast, reduce, all_to_all, send/recv): size = the input, factor 1.

An unknown size is NaN, so it drops out of sums that skip NaN and never looks like a real 0.
"""

from __future__ import annotations

import math
from typing import Any

# Element sizes by dtype name, lower case: NCCL kernel args say "Float", "BFloat16"; the profiler's
# "Input type" says "float", "c10::BFloat16", "long int".
DTYPE_BYTES = {
    "float": 4, "float32": 4, "double": 8, "float64": 8, "half": 2, "float16": 2, "c10::half": 2,
    "bfloat16": 2, "c10::bfloat16": 2, "long": 8, "long int": 8, "int64": 8, "int64_t": 8,
    "int": 4, "int32": 4, "short": 2, "short int": 2, "int16": 2, "char": 1, "signed char": 1,
    "byte": 1, "unsigned char": 1, "uint8": 1, "int8": 1, "bool": 1,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "c10::float8_e4m3fn": 1, "c10::float8_e5m2": 1,
}


def dtype_bytes(name: Any) -> float:
    """Bytes of one element of ``name``; NaN if unknown."""
    if not isinstance(name, str):
        return math.nan
    return float(DTYPE_BYTES.get(name.strip().lower(), math.nan))


def message_bytes(kind: str, input_bytes: float, output_bytes: float, group_size: int | None) -> float:
    """The nccl-tests size of one collective from its input and output bytes (NaN: unknown)."""
    if kind == "all_gather":
        if not math.isnan(output_bytes):
            return output_bytes
        return input_bytes * group_size if group_size else math.nan
    if kind in ("reduce_scatter", "all_reduce"):
        return input_bytes
    return input_bytes if not math.isnan(input_bytes) else output_bytes


def bus_factor(kind: str, group_size: int | None) -> float:
    """busbw / algbw for ``kind`` on ``group_size`` ranks (1 when the size is unknown)."""
    n = group_size or 0
    if n < 1:
        return 1.0
    if kind == "all_reduce":
        return 2.0 * (n - 1) / n
    if kind in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    return 1.0
