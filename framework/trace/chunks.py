"""The decompressed bytes of a trace, a chunk at a time, and three facts about them.

Per chunk, found from a rare byte (``.``, ``]``, ``P``) with vectorized numpy steps:

* whether any ``"ts":`` value is a float (``"ts":\\s*-?\\d+\\.``): HTA then rounds every
  timestamp of the file, so every byte must be looked at;
* where ``]`` follows ``}`` (whitespace aside): how ``traceEvents`` ends. The scanner cuts
  chunks of whole events only before such a place, so the array's end is always decoded and a
  key after the array ("distributedInfo", say) is never taken for events;
* where ``ProfilerStep`` occurs: the events the scanner decodes for the step markers.

The previous chunk's last bytes are kept in front for the walks to the left; a walk that reaches
their start is decided by a regex (float) or reported as a hit (array end), so no fact depends on
where a chunk boundary fell.

Inflating on a helper thread (zlib releases the GIL) was measured and dropped: zlib takes the
GIL back between output blocks, and each time it waits out the 5 ms switch interval while the
reader sits in a long regex, so on two cores it was slower than inflating in line.

Inflating is ISA-L's (``isal``, see pyproject.toml) where it is installed, zlib's elsewhere: the
same bytes, the same checks (CRC, length, truncation), the errors in :data:`INFLATE_ERRORS`.
"""

from __future__ import annotations

import codecs
import ctypes
import platform
import re
import zlib
from pathlib import Path
from typing import Callable

import numpy as np

try:  # see pyproject.toml: inflates the shared traces ~5x faster than zlib
    from isal import isal_zlib as _inflate
except ImportError:  # pragma: no cover - a declared dependency; zlib gives the same bytes
    _inflate = zlib

# What a corrupt gzip stream raises while it is inflated here (zlib's error, and ISA-L's).
INFLATE_ERRORS = (zlib.error, _inflate.error)

_FLOAT_TS = re.compile(rb'"ts":\s*-?\d+\.')
_CONTEXT = 256  # bytes of the previous chunk kept in front of the next for the walks left
_TS_KEY = np.frombuffer(b'"ts":', dtype=np.uint8)
_SPACE = np.zeros(256, dtype=bool)
_SPACE[list(b" \t\n\r\f\v")] = True  # the regex \s of bytes patterns
_DIGIT = np.zeros(256, dtype=bool)
_DIGIT[list(b"0123456789")] = True
_STEP = np.frombuffer(b"ProfilerStep", dtype=np.uint8)


# Reading a trace a chunk at a time allocates and frees megabyte buffers over and over (each inflated chunk, its
# numpy temporaries, the scanner's buffer). By default glibc's malloc maps the larger ones afresh, or hands the
# top of its heap back to the kernel as they are freed, so the next ones are faulted in again: reading the 54 MB
# shared trace took about 41,000 minor page faults. Serving buffers up to 32 MiB from the heap and keeping 16 MiB
# free at its top, set after the imports as ``shardlight analyze`` does, took about 2,900 in every process tried.
# The pad alone gave 2,900 to 32,000 (it fixes the mmap threshold wherever the imports left it). The peak RSS
# is the same, 46 MB: pages never touched are not resident.
HEAP_MMAP_THRESHOLD = 32 << 20  # glibc's largest
HEAP_TOP_PAD = 16 << 20
_M_TOP_PAD, _M_MMAP_THRESHOLD = -2, -3  # glibc malloc.h


def keep_heap_top(pad: int = HEAP_TOP_PAD, mmap_threshold: int = HEAP_MMAP_THRESHOLD) -> bool:
    """Ask glibc's malloc to serve buffers up to ``mmap_threshold`` bytes from its heap and to keep ``pad`` bytes
    free at the heap's top instead of returning them to the kernel (``mallopt(M_MMAP_THRESHOLD)``,
    ``mallopt(M_TOP_PAD)``), for a process whose work is reading large traces (``shardlight analyze``). It holds for
    the rest of the process and fixes malloc's other thresholds, so the command calls it, never the library: a
    training process that analyses its comm windows keeps glibc's defaults. False where the C library is not
    glibc (nothing is changed there)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(None)
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, int(mmap_threshold))) & bool(libc.mallopt(_M_TOP_PAD, int(pad)))
    except (OSError, AttributeError):
        return False


def _walk_left(data: np.ndarray, at: np.ndarray, kind: np.ndarray) -> np.ndarray:
    """For each index, step left while the byte there is of ``kind``; -1 if it ran off the start."""
    at = at.copy()
    moving = np.arange(at.size)
    while moving.size:
        spot = at[moving]
        inside = spot >= 0
        still = inside & kind[data[np.where(inside, spot, 0)]]
        moving = moving[still]
        at[moving] -= 1
    return at


def _rare_bytes(data: np.ndarray, dots: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Where the facts start from, found in one pass: the "." (if ``dots``) and "]" in
    ``data[_CONTEXT:]``, and the "P" that may begin a "ProfilerStep" ending there.

    One mask and one ``flatnonzero`` for all three bytes, not one each: finding the indices is most
    of the facts' cost (the facts took 0.84 ns a byte of the shared traces with timestamps in ints).
    """
    start = _CONTEXT - len(_STEP) + 1
    body = data[start:]
    mask = body == 93
    np.logical_or(mask, body == 80, out=mask)
    if dots:
        np.logical_or(mask, body == 46, out=mask)
    at = np.flatnonzero(mask) + start
    byte = data[at]
    inside = at >= _CONTEXT
    return at[(byte == 46) & inside], at[(byte == 93) & inside], at[byte == 80]


def _float_ts(data: np.ndarray, dots: np.ndarray) -> bool | None:
    """Whether a float ``"ts"`` value has its "." (one of ``dots``) in ``data[_CONTEXT:]``; None if the
    context is too short."""
    if not dots.size:
        return False
    dots = dots[_DIGIT[data[dots - 1]]]  # "\d+" needs one digit
    at = _walk_left(data, dots - 1, _DIGIT)
    at = np.where((at >= 0) & (data[np.maximum(at, 0)] == 45), at - 1, at)  # "-?"
    at = _walk_left(data, at, _SPACE)
    if (at < len(_TS_KEY) - 1).any():
        return None
    window = data[at[:, None] + np.arange(1 - len(_TS_KEY), 1)]
    return bool((window == _TS_KEY).all(axis=1).any())


def _array_ends(data: np.ndarray, closing: np.ndarray) -> np.ndarray:
    """Those of the "]" at ``closing`` that follow "}" (whitespace aside), or whose walk ran off the start.

    The "]" stands in for its "}": only whitespace lies between them, so no event boundary does.
    """
    at = _walk_left(data, closing - 1, _SPACE)
    return closing[(at < 0) | (data[np.maximum(at, 0)] == 125)]


def _step_marks(data: np.ndarray, at: np.ndarray) -> np.ndarray:
    """Those of the "P" at ``at`` that start a "ProfilerStep" (ending in ``data[_CONTEXT:]``: the rest were
    reported)."""
    size = len(_STEP)
    at = at[at + size <= data.size]
    at = at[data[at + 1] == _STEP[1]]  # "P" is common in some traces ("Pr" is not): fewer rows below
    return at[(data[at[:, None] + np.arange(size)] == _STEP).all(axis=1)]


class Chunks:
    """Decompressed chunks of a file, each with the facts above; see ``next``."""

    def __init__(self, path: Path, chunk_bytes: int, checks_float: Callable[[int], bool] | None = None):
        """``checks_float``: whether to look for a float timestamp in the chunk at a file offset (None: in
        every chunk). A part of a scan in parts (:func:`.fastscan.scan_part`) looks in its share of the
        chunks; the parts' answers together are the file's."""
        self._checks_float = checks_float
        # The chunks that end at or before this file offset are only inflated and checked as UTF-8,
        # with no facts (a part of a scan in parts, on its way to its next block).
        self.facts_from = 0
        self._handle = open(path, "rb")
        self._gzip = self._handle.read(2) == b"\x1f\x8b"
        self._handle.seek(0)
        # Half a MiB (the reader's default): every pass over a chunk (inflate, numpy, counts,
        # regexes) then runs in cache; 1 MiB measured 5-25% slower in total, 4 MiB 25-30%.
        self._out = max(chunk_bytes, 1 << 12)
        self._source = self._inflated() if self._gzip else self._raw()
        self.done = False
        self.float_ts = False  # whether the bytes returned so far hold a float "ts"
        # The slow reader validates UTF-8 over the whole file; so must the fast one.
        self._utf8 = codecs.getincrementaldecoder("utf-8")()
        self._context, self._offset = b"\0" * _CONTEXT, 0

    def _raw(self):
        size = self._out // 16 if self._gzip else self._out
        while True:
            data = self._handle.read(max(size, 1024))
            if not data:
                return
            yield data

    def _inflated(self):
        inflater = _inflate.decompressobj(31)
        for data in self._raw():
            if inflater.eof:
                raise EOFError("data after the gzip stream")  # multi-member: the slow reader
            while data and not inflater.eof:
                yield inflater.decompress(data, self._out)
                data = inflater.unconsumed_tail
            if data or inflater.unused_data:
                raise EOFError("data after the gzip stream")
        yield inflater.flush()
        if not inflater.eof:
            raise EOFError("truncated gzip data")

    def next(self) -> tuple[bytes, list[int], list[int]] | None:
        """The next chunk, the file offsets of its array ends and "ProfilerStep"s; None at the end."""
        if self.done:
            return None
        data = b""
        try:
            while not data:
                data = next(self._source, None)
                if data is None:
                    self.done = True
                    self._utf8.decode(b"", final=True)
                    return None
        except BaseException:
            self.done = True
            raise
        if not data.isascii():
            self._utf8.decode(data)
        if self._offset + len(data) <= self.facts_from:  # on the way to a part's block: only the bytes
            self._context = (self._context + data[-_CONTEXT:])[-_CONTEXT:]
            self._offset += len(data)
            return data, [], []
        joined = self._context + data
        view = np.frombuffer(joined, dtype=np.uint8)
        check_float = not self.float_ts and (self._checks_float is None or self._checks_float(self._offset))
        dots, closing, marks = _rare_bytes(view, check_float)
        if check_float:
            found = _float_ts(view, dots)
            self.float_ts = _FLOAT_TS.search(joined) is not None if found is None else found
        ends = (_array_ends(view, closing) + (self._offset - _CONTEXT)).tolist()
        steps = (_step_marks(view, marks) + (self._offset - _CONTEXT)).tolist()
        self._context = joined[-_CONTEXT:]
        self._offset += len(data)
        return data, ends, steps

    def close(self) -> None:
        self._handle.close()
