"""This rank's flight recorder (torch's record of its last collectives, on in every run:
``trainer.flight_recorder_entries``), read in torch's dump format, for the callbacks that use it: the hang watchdog
dumps it whole, the comm callback takes the collectives a profiled window issued, whose process groups a gloo
trace does not name."""

from __future__ import annotations

import pickle
from typing import Any, Dict, List

import torch
import torch.distributed as dist


def recorder_dump() -> Dict[str, Any]:
    """torch's dump of this rank's recorder (``version``, ``entries``, ``pg_status``), with ``pg_config`` holding
    each process group's members (gloo's dump leaves them out), so that a reader can tell which ranks owe each
    collective. Empty entries when this torch has no recorder or it is off."""
    try:
        dump = pickle.loads(torch._C._distributed_c10d._dump_fr_trace(True, False, False))  # noqa: SLF001
    except (AttributeError, RuntimeError):
        dump = {"version": "", "entries": [], "pg_status": {}}
    world = dist.distributed_c10d._world  # noqa: SLF001 - the process groups' names, as the recorder logs them
    dump["pg_config"] = {
        name: {"name": name, "desc": getattr(pg, "group_desc", name), "ranks": str(sorted(world.pg_group_ranks[pg]))}
        for pg, name in world.pg_names.items() if pg in world.pg_group_ranks
    }
    return dump


def issued_marks() -> Dict[str, int]:
    """How many collectives each process group (by id) has issued so far: a mark between two moments, cheap
    (0.1-2 ms: no entries are dumped) on the training thread."""
    try:
        status = pickle.loads(torch._C._distributed_c10d._dump_fr_trace(False, False, True))  # noqa: SLF001
    except (AttributeError, RuntimeError):
        return {}
    return {str(pg): int(s.get("last_enqueued_collective", -1)) for pg, s in (status.get("pg_status") or {}).items()}


def issued_between(start: Dict[str, int], end: Dict[str, int]) -> List[Dict[str, Any]]:
    """The collectives this rank issued between two :func:`issued_marks`, in issue order: each its name as the
    recorder logs it (``gloo:all_reduce``), its process group's name and description, and the group's ranks.
    Dumping the entries costs tens of milliseconds: call it off the training thread (the recorder keeps
    ``trainer.flight_recorder_entries`` of them, so soon enough)."""
    dump = recorder_dump()
    groups = dump["pg_config"]
    issued = []
    for entry in sorted(dump["entries"], key=lambda e: e["record_id"]):
        pg, seq = str(entry.get("pg_id")), int(entry.get("collective_seq_id", 0))
        if entry.get("is_p2p") or not start.get(pg, 0) < seq <= end.get(pg, -1):
            continue
        name, desc = (str(part) for part in entry["process_group"])
        ranks = groups.get(name, {}).get("ranks")
        issued.append({"op": entry["profiling_name"], "group": name, "desc": desc,
                       "ranks": [int(r) for r in ranks.strip("[]").split(",") if r.strip()] if ranks else None})
    return issued
