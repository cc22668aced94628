"""A stuck run, named: which rank is missing from which collective, from the ranks' flight-recorder dumps.

Every rank of a shardlight run keeps torch's flight recorder (``trainer.flight_recorder_entries``): its last
collectives, each with its process group, sequence id, sizes and whether it finished. When a run stops making
progress the hang watchdog (``shardlight.callbacks.hang``) has each rank dump its recorder to
``run_dir/flight_recorder/rank_<R>`` in torch's own format (the format torch's NCCL watchdog writes with
``TORCH_FR_DUMP_TEMP_FILE``, which a run points at the same folder), plus, under the key ``shardlight``, the
rank's Python stack and how long it had gone without a step. This module reads such a folder and says:

* **missing**: ranks wait in collective #N of a group that another member never entered (it stopped short of it:
  a rank-dependent branch, a stuck data loader, a deadlock); that rank's last finished collective and stack;
* **stopped**: a member wrote no dump at all (SIGSTOPped, swapped out, a dead host): it stopped responding in
  the collective the others wait in;
* **mismatch**: every member is in collective #N of a group, but not the same one (another op, other sizes);
* **waiting**: all members are in the same collective and none finished it (a transport that hangs).

torch ships an analyzer of these dumps (``torch.distributed.flight_recorder``); it reads NCCL dumps but fails
on gloo's (``pg_config`` names the default group ``''`` where its entries say ``'0'``), and it reports the
first mismatch across the whole history rather than where the ranks are now. So the loader is torch's format
and the diagnosis is written here.
"""

from __future__ import annotations

import ast
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from shardlight.run_context import FLIGHT_RECORDER_PREFIX

_DTYPE_BYTES = {"Float": 4, "BFloat16": 2, "Half": 2, "Double": 8, "Long": 8, "Int": 4, "Byte": 1, "Bool": 1,
                "Char": 1, "Short": 2, "Float8_e4m3fn": 1, "Float8_e5m2": 1}
# What each process group of a shardlight run is, by its description (DeviceMesh names it mesh_<dim>).
_GROUP_ROLES = {"default_pg": "the default group", "mesh_shard": "the FSDP shard group",
                "mesh_dp_shard": "the FSDP shard group", "mesh_replicate": "the FSDP replicate group",
                "mesh_dp_replicate": "the FSDP replicate group", "mesh_tp": "the tensor-parallel group"}


@dataclass
class Collective:
    """One flight-recorder entry: a collective as one rank issued it."""

    group: str
    seq: int
    op: str
    sizes: Tuple[Tuple[int, ...], ...]
    nbytes: int
    finished: bool

    @classmethod
    def of(cls, entry: Dict[str, Any]) -> "Collective":
        sizes = tuple(tuple(size) for size in entry.get("input_sizes") or ())
        dtypes = entry.get("input_dtypes") or []
        nbytes = sum(_numel(size) * _DTYPE_BYTES.get(dtype, 4) for size, dtype in zip(sizes, dtypes))
        name = str(entry.get("profiling_name", "?")).split(":", 1)[-1]
        finished = bool(entry.get("retired")) or entry.get("state") == "completed"
        return cls(group=str(entry["process_group"][0]), seq=int(entry["collective_seq_id"]), op=name,
                   sizes=sizes, nbytes=nbytes, finished=finished)

    def same_call(self, other: "Collective") -> bool:
        return (self.op, self.sizes) == (other.op, other.sizes)

    def label(self) -> str:
        return f"{self.op} #{self.seq}"


@dataclass
class RankDump:
    """One rank's dump: its collectives (oldest first), its groups and, when shardlight wrote it, its stack."""

    rank: int
    collectives: List[Collective]
    groups: Dict[str, List[int]] = field(default_factory=dict)
    stack: Optional[str] = None
    idle_s: Optional[float] = None
    step: Optional[int] = None

    def pending(self) -> Optional[Collective]:
        """The oldest collective this rank issued and has not finished: where it waits."""
        return next((c for c in self.collectives if not c.finished), None)

    def last_in(self, group: str) -> Optional[Collective]:
        return next((c for c in reversed(self.collectives) if c.group == group), None)


@dataclass
class Groups:
    """The process groups' descriptions, by name (a group's members are each rank's own view: groups made by
    ``split_group`` share a name across disjoint sets of ranks)."""

    desc: Dict[str, str] = field(default_factory=dict)

    def label(self, name: str, members: List[int]) -> str:
        desc = self.desc.get(name, name)
        members = _ranks(members)
        role = _GROUP_ROLES.get(desc)
        if role == "the default group":
            return f"{role} (ranks {members})"
        return f"{role} ({desc}: ranks {members})" if role else f"group {desc} (ranks {members})"


def _numel(size: Tuple[int, ...]) -> int:
    n = 1
    for d in size:
        n *= int(d)
    return n


def _ranks(ranks: List[int]) -> str:
    ranks = sorted(ranks)
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks))


def _mb(nbytes: int) -> str:
    return f"{nbytes / 1e6:.2f} MB" if nbytes >= 10_000 else f"{nbytes} B"


def read_dumps(folder: Path) -> Tuple[Dict[int, RankDump], Groups, Dict[str, Any]]:
    """Every ``rank_<R>`` dump in ``folder`` (torch's pickle format), the groups they name, and the run facts
    shardlight put beside them (``world_size``); a file that is not a dump is skipped."""
    dumps: Dict[int, RankDump] = {}
    groups = Groups()
    facts: Dict[str, Any] = {}
    for path in sorted(folder.glob(f"{FLIGHT_RECORDER_PREFIX}*")):
        suffix = path.name[len(FLIGHT_RECORDER_PREFIX):]
        if not suffix.isdigit():
            continue
        try:
            with open(path, "rb") as fh:
                dump = pickle.load(fh)  # noqa: S301 - the run's own files, the format torch writes
        except (OSError, pickle.UnpicklingError, EOFError):
            continue
        rank = int(suffix)
        own: Dict[str, List[int]] = {}
        for name, config in (dump.get("pg_config") or {}).items():
            members = config.get("ranks", "[]")
            members = ast.literal_eval(members) if isinstance(members, str) else list(members)
            if name and members:
                own[str(name)] = sorted(int(r) for r in members)
                groups.desc[str(name)] = str(config.get("desc") or name)
        entries = sorted(dump.get("entries") or [], key=lambda e: e.get("record_id", 0))
        collectives = [Collective.of(e) for e in entries if not e.get("is_p2p")]
        for e in entries:
            groups.desc.setdefault(str(e["process_group"][0]), str(e["process_group"][1]))
        extra = dump.get("shardlight") or {}
        if extra.get("world_size"):
            facts["world_size"] = extra["world_size"]
        dumps[rank] = RankDump(rank=rank, collectives=collectives, groups=own, stack=extra.get("stack"),
                               idle_s=extra.get("idle_s"), step=extra.get("step"))
    return dumps, groups, facts


@dataclass
class HangVerdict:
    """What the dumps say: ``kind`` (missing, stopped, mismatch, waiting, none), the collective, the ranks that
    wait in it, the ranks at fault, the lines of the console block, and the one ``error:`` line."""

    kind: str
    error: str
    lines: List[str]
    collective: Optional[str] = None
    group: Optional[str] = None
    waiting: List[int] = field(default_factory=list)
    culprits: List[int] = field(default_factory=list)

    def to_dict(self) -> Dict[str, Any]:
        return {"kind": self.kind, "error": self.error, "collective": self.collective, "group": self.group,
                "waiting": self.waiting, "culprits": self.culprits, "lines": self.lines}


def _members(dump: RankDump, group: str, world_size: int) -> List[int]:
    return dump.groups.get(group) or list(range(world_size))


def _stuck_collective(dumps: Dict[int, RankDump], world_size: int) -> Optional[Tuple[Collective, List[int]]]:
    """Where the chain of waiting ends, and that group's members: the collective a member of which is in no
    collective at all (or wrote no dump). Rank 0 may wait on rank 2 in an FSDP all-gather while rank 2 waits on
    rank 3 in a tensor-parallel one: the TP collective is the news. Ties: the most waiting ranks, then the
    lowest sequence id."""
    waits: Dict[Tuple[str, Tuple[int, ...], int], List[Collective]] = {}
    for dump in dumps.values():
        pending = dump.pending()
        if pending is not None:
            key = (pending.group, tuple(_members(dump, pending.group, world_size)), pending.seq)
            waits.setdefault(key, []).append(pending)
    if not waits:
        return None

    def ends_the_chain(key: Tuple[str, Tuple[int, ...], int]) -> bool:
        return any(r not in dumps or dumps[r].pending() is None for r in key[1])

    key = max(waits, key=lambda k: (ends_the_chain(k), len(waits[k]), -k[2]))
    return waits[key][0], list(key[1])


def _where(dump: RankDump, groups: Groups, world_size: int) -> str:
    pending = dump.pending()
    if pending is None:
        return "not in any collective"
    return f"waiting in {pending.label()} of {groups.label(pending.group, _members(dump, pending.group, world_size))}"


def _stack_lines(dump: RankDump, indent: str = "      ", keep: int = 3) -> List[str]:
    """The innermost ``keep`` frames of the rank's stack that are not an installed package's (torch's module
    call machinery, Lightning's loops), after the innermost frame of all: where it is, and whose code put it
    there."""
    frames: List[List[str]] = []
    for line in (dump.stack or "").rstrip().splitlines():
        if line.lstrip().startswith("File ") or not frames:
            frames.append([line])
        else:
            frames[-1].append(line)
    if not frames:
        return []
    ours = [f for f in frames[:-1] if "site-packages" not in f[0] and "dist-packages" not in f[0]]
    shown = ours[-keep:] + [frames[-1]]
    return [f"{indent}{line.rstrip()}" for frame in shown for line in frame]


def _s(ranks: List[int]) -> str:
    return "s" if len(ranks) == 1 else ""


def diagnose_hang(dumps: Dict[int, RankDump], groups: Groups, world_size: int) -> HangVerdict:
    """The verdict of a stuck run from its ranks' dumps; ``world_size`` says which ranks wrote none."""
    found = _stuck_collective(dumps, world_size)
    idle = max((d.idle_s for d in dumps.values() if d.idle_s is not None), default=None)
    steps = [d.step for d in dumps.values() if d.step is not None]
    head = f"hang: no step finished for {idle:.0f} s" if idle is not None else "hang"
    head += f" (after step {max(steps)})" if steps else ""
    head += f"; flight recorder of {len(dumps)} of {world_size} ranks"
    if found is None:
        silent = [r for r in range(world_size) if r not in dumps]
        who = f"; rank {_ranks(silent)} wrote no dump" if silent else ""
        error = f"error: no step finished, but no rank is inside a collective{who}: a rank is busy elsewhere"
        lines = [head]
        for dump in dumps.values():
            lines += [f"  rank {dump.rank}: {_where(dump, groups, world_size)}, at:", *_stack_lines(dump, "    ")]
        return HangVerdict(kind="none", error=error, lines=lines)

    stuck, members = found
    label = groups.label(stuck.group, members)
    waiting: List[int] = []
    missing: List[int] = []
    stopped: List[int] = []
    mismatched: List[Tuple[int, Collective]] = []
    for rank in members:
        dump = dumps.get(rank)
        mine = None if dump is None else next(
            (c for c in dump.collectives if c.group == stuck.group and c.seq == stuck.seq), None)
        if dump is None:
            stopped.append(rank)
        elif mine is None:  # its last collective in this group is an earlier one
            missing.append(rank)
        elif mine.same_call(stuck) and not mine.finished:
            waiting.append(rank)
        else:  # another op or other sizes under the same sequence id (gloo may even let one side finish it)
            mismatched.append((rank, mine))
    lines = [head, f"  {stuck.label()} in {label}, {_mb(stuck.nbytes)} per rank:",
             f"    waiting in it: rank {_ranks(waiting)}" if waiting else "    waiting in it: none"]
    what = f"{stuck.label()} of {label}"
    verdict = dict(collective=stuck.label(), group=label, waiting=waiting)
    if mismatched:
        theirs = "; ".join(f"rank {r}: {c.op} {[list(x) for x in c.sizes]}{' (finished)' if c.finished else ''}"
                           for r, c in mismatched)
        ours = f"rank {_ranks(waiting)}: {stuck.op} {[list(x) for x in stuck.sizes]}"
        lines.append(f"    mismatch: {ours}; {theirs}")
        error = f"error: collective mismatch in {what}: {ours}; {theirs}"
        return HangVerdict("mismatch", error, lines, culprits=[r for r, _ in mismatched], **verdict)
    for rank in missing:
        dump = dumps[rank]
        last = dump.last_in(stuck.group)
        at = ", at:" if dump.stack else " (its dump has no stack)"
        lines.append(f"    never entered it: rank {rank}, last in this group {last.label() if last else 'nothing'}; "
                     f"now {_where(dump, groups, world_size)}{at}")
        lines += _stack_lines(dump)
    for rank in stopped:
        lines.append(f"    no dump: rank {rank} (stopped, swapped out, or its host is gone)")
    elsewhere = [d for r, d in sorted(dumps.items()) if r not in members and d.pending() is not None]
    lines += [f"  rank {d.rank}: {_where(d, groups, world_size)}" for d in elsewhere]
    if missing:
        stacks = "; its stack is above" if any(dumps[r].stack for r in missing) else ""
        error = (f"error: rank {_ranks(missing)} never entered {what}, which rank {_ranks(waiting)} "
                 f"wait{_s(waiting)} in{stacks}")
        return HangVerdict("missing", error, lines, culprits=missing, **verdict)
    if stopped:
        error = (f"error: rank {_ranks(stopped)} stopped responding in {what}: it wrote no flight-recorder dump; "
                 f"rank {_ranks(waiting)} wait{_s(waiting)} in it")
        return HangVerdict("stopped", error, lines, culprits=stopped, **verdict)
    error = f"error: every rank of {label} waits in {stuck.label()} and none finished it: the transport hangs"
    return HangVerdict("waiting", error, lines, **verdict)


def hang_report(folder: Path, world_size: Optional[int] = None) -> Optional[HangVerdict]:
    """The verdict of the dumps in ``folder``; None when it holds none. ``world_size``: the run's (default: what
    the dumps say, else one more than the highest rank any dump names)."""
    dumps, groups, facts = read_dumps(folder)
    if not dumps:
        return None
    named = [max(dumps)] + [max(m) for d in dumps.values() for m in d.groups.values()]
    size = world_size or int(facts.get("world_size") or 0) or max(named) + 1
    return diagnose_hang(dumps, groups, size)
