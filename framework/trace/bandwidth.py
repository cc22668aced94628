"""Bus bandwidth of matched collectives, per collective kind and per message-size bucket.

Each collective instance contributes its size (nccl-tests' convention, :mod:`.sizes`) and its
transfer time: the mean over its ranks of the part of the collective after the last rank
arrived, so a straggler's wait does not read as a slow link. Aggregates are weighted by time
(total bytes / total transfer time), as a link would see them:

* ``algbw_gbps = bytes / transfer time`` (GB/s, 1e9 bytes);
* ``busbw_gbps = sum(bytes_i * factor_i) / sum(time_i)`` with nccl-tests' bus factor of each
  instance's kind and group size;
* with a link peak, ``peak_pct = 100 * busbw / peak``.

Only instances of known size and positive transfer time enter the bandwidths and the buckets;
``count`` and ``transfer_us`` of a kind count every instance of it.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

from shardlight.trace.sizes import bus_factor

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def _size_label(size: int) -> str:
    unit = 0
    while size >= 1024 and unit < len(_UNITS) - 1:
        size //= 1024
        unit += 1
    return f"{size}{_UNITS[unit]}"


def bucket_of(size: float) -> str:
    """The power-of-4 bucket of a size in bytes: ``[4^k, 4^(k+1))``, labelled like "256KiB-1MiB"."""
    exponent = max(0, int(math.floor(math.log(max(size, 1.0), 4))))
    while 4 ** (exponent + 1) <= size:  # floating-point log at exact powers
        exponent += 1
    while exponent > 0 and 4 ** exponent > size:
        exponent -= 1
    return f"{_size_label(4 ** exponent)}-{_size_label(4 ** (exponent + 1))}"


def _rates(total_bytes: float, bus_bytes: float, seconds_us: float, peak: float | None) -> dict[str, Any]:
    algbw = total_bytes / seconds_us / 1e3 if seconds_us > 0 else None
    busbw = bus_bytes / seconds_us / 1e3 if seconds_us > 0 else None
    rates: dict[str, Any] = {"algbw_gbps": algbw, "busbw_gbps": busbw}
    if peak:
        rates["peak_pct"] = 100.0 * busbw / peak if busbw is not None else None
    return rates


class _Sum:
    def __init__(self) -> None:
        self.count = 0
        self.bytes = 0.0
        self.bus_bytes = 0.0
        self.transfer_us = 0.0  # of the sized instances: the bandwidths' denominator
        self.all_transfer_us = 0.0

    def add(self, size: float | None, factor: float, transfer_us: float) -> None:
        self.count += 1
        self.all_transfer_us += transfer_us
        if size is not None and transfer_us > 0:
            self.bytes += size
            self.bus_bytes += size * factor
            self.transfer_us += transfer_us

    def report(self, peak: float | None) -> dict[str, Any]:
        known = self.bytes if self.transfer_us > 0 else None  # no sized instance: the bytes are unknown
        return {"count": self.count, "bytes": known, "transfer_us": round(self.all_transfer_us, 3),
                **_rates(self.bytes, self.bus_bytes, self.transfer_us, peak)}


def bandwidth(collectives: list[tuple[str, float | None, int | None, float]],
              link_peak_gbps: float | None = None) -> dict[str, dict[str, Any]]:
    """Per kind: ``{count, bytes, transfer_us, algbw_gbps, busbw_gbps, group_size, buckets}``.

    ``collectives``: one ``(kind, bytes or None, group size or None, mean transfer us)`` per
    instance (a matched collective once, an unmatched one once per rank that has it).
    """
    kinds: dict[str, _Sum] = {}
    buckets: dict[str, dict[str, _Sum]] = {}
    sizes: dict[str, Counter] = {}
    for kind, size, group_size, transfer_us in collectives:
        factor = bus_factor(kind, group_size)
        kinds.setdefault(kind, _Sum()).add(size, factor, transfer_us)
        sizes.setdefault(kind, Counter())[group_size] += 1
        if size is not None and transfer_us > 0:
            buckets.setdefault(kind, {}).setdefault(bucket_of(size), _Sum()).add(size, factor, transfer_us)
    report = {}
    for kind in sorted(kinds):
        entry = kinds[kind].report(link_peak_gbps)
        entry["group_size"] = sizes[kind].most_common(1)[0][0]
        by_size = buckets.get(kind, {})
        order = sorted(by_size, key=lambda label: by_size[label].bytes / by_size[label].count)
        entry["buckets"] = {label: by_size[label].report(link_peak_gbps) for label in order}
        report[kind] = entry
    return report
