"""A growable byte window over a trace's chunks (:class:`.chunks.Chunks`), for the fast scan
(:mod:`.fastscan`): read one JSON token or value at a time, find where the events array may end, and,
for a scan in parts, the event start where a block begins or ends."""

from __future__ import annotations

import json
import re
from bisect import bisect_left

from shardlight.trace.chunks import Chunks


class FastPathMiss(Exception):
    """The fast pass met something it cannot handle exactly; the file must be read in full."""


_WS = re.compile(rb"[ \t\n\r]*")
_DECODER = json.JSONDecoder()
# Where a block of a scan in parts begins: the "{" of the first match at or after its start offset
# (the whitespace of fastscan's _last_event_start, which cuts runs at the same kind of place).
_EVENT_START = re.compile(rb"\}[ \t\n\r]*+,[ \t\n\r]*+\{")


class Window:
    """A growable byte window over the chunks, for reading one JSON token or value at a time."""

    def __init__(self, chunks: Chunks):
        self._chunks = chunks
        self.buf = b""
        self.pos = 0
        self.eof = False
        self.base = 0  # file offset of buf[0]
        # File offsets of "]" after "}" and of "ProfilerStep" (see chunks.py), ascending.
        self._ends: list[int] = []
        self._first_end = 0
        self.steps: list[int] = []
        # A block's boundary (file offset), and the first event start at or after it once the window
        # has read that far (_EVENT_START): where the block ends, or, sought from its start, begins.
        self._boundary: int | None = None
        self.stop: int | None = None

    def fill(self) -> bool:
        item = None if self.eof else self._chunks.next()
        if item is None:
            self.eof = True
            return False
        data, ends, steps = item
        keep = self.pos  # buf[keep:] stays: from the boundary on while its event start is not found
        if self._boundary is not None and self.stop is None:
            keep = min(keep, max(self._boundary - self.base, 0))
        self.base += keep
        self.buf = self.buf[keep:] + data
        self.pos -= keep
        self._ends.extend(ends)
        self.steps.extend(steps)
        self._find_stop()
        return True

    def end_at(self, boundary: int | None) -> None:
        """Stop at the first event start at or after file offset ``boundary`` (None: never)."""
        self._boundary, self.stop = boundary, None
        self._find_stop()

    def seek_event(self, boundary: int) -> int | None:
        """Move to the first event start at or after file offset ``boundary`` and return its offset
        (None: there is none). The chunks that end before ``boundary`` are only inflated (no facts)."""
        self.end_at(boundary)
        self._chunks.facts_from = boundary
        try:
            while self.stop is None:
                self.pos = len(self.buf)  # fill keeps the bytes from the boundary on
                if not self.fill():
                    return None
        finally:
            self._chunks.facts_from = 0
        self.pos = self.stop - self.base
        return self.stop

    def _find_stop(self) -> None:
        if self._boundary is None or self.stop is not None or self.base + len(self.buf) <= self._boundary:
            return
        found = _EVENT_START.search(self.buf, self._boundary - self.base)
        if found is not None:
            self.stop = self.base + found.end() - 1

    def array_end(self, start: int) -> int:
        """Index in buf of the first possible array end at or after buf[start], else len(buf)."""
        ends = self._ends
        self._first_end = bisect_left(ends, self.base + start, self._first_end)
        if self._first_end < len(ends):
            return min(ends[self._first_end] - self.base, len(self.buf))
        return len(self.buf)

    def peek(self) -> int:
        while True:
            self.pos = _WS.match(self.buf, self.pos).end()
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if not self.fill():
                return -1

    def expect(self, chars: bytes) -> int:
        char = self.peek()
        if char < 0 or char not in chars:
            raise FastPathMiss(f"expected {chars!r}")
        self.pos += 1
        return char

    def value(self):
        self.peek()
        size = 1 << 16
        while True:
            buf, pos = self.buf, self.pos
            raw = buf[pos:pos + size]
            try:
                text = raw.decode()
            except UnicodeDecodeError as exc:
                if exc.end < len(raw):
                    raise
                text = raw[:exc.start].decode()  # the window cut a character; try without it
            end = pos + len(raw)
            try:
                obj, used = _DECODER.raw_decode(text)
            except json.JSONDecodeError:
                used = -1
            # A value that ends at the window edge (a number, say) may go on past it.
            if used >= 0 and (used < len(text) or (end == len(buf) and self.eof)):
                self.pos = pos + (used if text.isascii() else len(text[:used].encode()))
                return obj
            if end < len(buf):
                size *= 8
            elif not self.fill() and used < 0:
                raise FastPathMiss("invalid JSON value")
