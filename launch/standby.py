"""Standby ranks: the other local ranks started while the launching process still imports, so that their
imports run beside its own instead of after them.

Lightning's subprocess launcher starts ranks 1..N-1 when ``Trainer.fit`` sets up the strategy: by then rank 0
has imported torch, Lightning and transformers (about 4 s on a 2-core machine) and each new rank imports them
again while rank 0 waits for it in the process group's rendezvous, so the start-up pays the imports twice.
Here the launching process starts those ranks as soon as the recipe has loaded. Each runs the same command
line Lightning would run, imports, and then waits on its standard input, its output held back:

* **hand-off** (:meth:`StandbyRanks.hand_off`, called where Lightning would start the ranks): the rank reads
  the environment Lightning would have given it, one JSON line, takes it as its own, writes out what it held
  back and carries on as the rank Lightning would have started. A standby that died meanwhile is replaced by
  a fresh process, started as Lightning starts one.
* **called off** (:meth:`StandbyRanks.cancel`: the preflight refused the run, or it ended before ``fit``): the
  standby is killed, its held-back output dropped; a standby whose launching process died reads the end of
  its input and exits. Bad input still gets its one line from rank 0 alone.

The standby's own variables (``ENV_STANDBY``, and the rank variables Lightning's children see while they
import) are set at its start, a process boundary; the hand-off replaces its whole environment.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Callable, Dict, List, Mapping, Optional

from shardlight.launch.base import ENV_STANDBY


def rank_command() -> List[str]:
    """The command line Lightning's subprocess launcher starts a rank with: this process's own
    (``lightning.fabric.strategies.launchers.subprocess_script._basic_subprocess_cmd``)."""
    import __main__

    spec = getattr(__main__, "__spec__", None)
    if spec is None:
        return [sys.executable, os.path.abspath(sys.argv[0])] + sys.argv[1:]
    return [sys.executable, "-m", spec.name] + sys.argv[1:]


def standby_pays(launcher: str, ranks_per_node: int, num_nodes: int) -> bool:
    """Where Lightning's own launcher will start the other ranks: a one-node run of several ranks that no
    launcher (torchrun, srun) started."""
    return launcher == "local" and num_nodes == 1 and ranks_per_node > 1


class StandbyRanks:
    """Local ranks 1..N-1, started ahead of Lightning's launcher (see the module docstring).

    Arguments:
        procs: local rank -> its standby process (standard input a pipe to this process).
        command: the command line they run, and that a replacement runs.
    """

    def __init__(self, procs: Dict[int, subprocess.Popen], command: List[str]) -> None:
        self.procs = procs
        self.command = command
        self.handed_off = False

    @classmethod
    def start(cls, ranks_per_node: int, environ: Mapping[str, str],
              command: Optional[List[str]] = None) -> "StandbyRanks":
        """Start ranks 1..``ranks_per_node``-1 of a one-node run in standby, with ``environ`` and the
        variables Lightning's launcher gives a rank it starts (``LOCAL_RANK``, ``NODE_RANK``, ``WORLD_SIZE``:
        libraries read the rank while they import)."""
        command = command or rank_command()
        procs = {}
        for local_rank in range(1, ranks_per_node):
            env = {**environ, ENV_STANDBY: "1", "LOCAL_RANK": str(local_rank), "NODE_RANK": "0",
                   "WORLD_SIZE": str(ranks_per_node)}
            procs[local_rank] = subprocess.Popen(command, env=env, stdin=subprocess.PIPE)
        return cls(procs, command)

    def hand_off(self, environs: Mapping[int, Mapping[str, str]]) -> List[subprocess.Popen]:
        """Give each standby rank its environment and let it run; the processes, in rank order. A standby
        that has died is replaced by a fresh process with that environment."""
        self.handed_off = True
        for local_rank, proc in self.procs.items():
            if local_rank not in environs and proc.poll() is None:
                proc.kill()  # a rank the launcher does not start after all
        out = []
        for local_rank, env in sorted(environs.items()):
            proc = self.procs.get(local_rank)
            try:
                if proc is None or proc.poll() is not None:
                    raise BrokenPipeError
                proc.stdin.write((json.dumps(dict(env)) + "\n").encode())
                proc.stdin.close()
            except (BrokenPipeError, OSError):
                if proc is not None and proc.poll() is None:
                    proc.kill()
                proc = subprocess.Popen(self.command, env=dict(env))
            out.append(proc)
        return out

    def cancel(self) -> None:
        """Stop the standby ranks that were never handed off (nothing of theirs is printed)."""
        if self.handed_off:
            return
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs.values():
            proc.wait()
            if proc.stdin is not None:
                proc.stdin.close()


def serve_as_standby(prepare: Callable[[], object]) -> None:
    """In a process started as a standby rank (``ENV_STANDBY``): run ``prepare`` (the imports) with the
    output held back, wait for the hand-off, take its environment as this process's, write out what was held
    back and return. The end of input, or an interrupt, ends the process quietly. Elsewhere: nothing."""
    if os.environ.get(ENV_STANDBY) != "1":
        return
    held = _HeldOutput()
    try:
        prepare()
        line = sys.stdin.buffer.readline()
    except KeyboardInterrupt:
        os._exit(130)
    if not line:  # called off, or the launching process died
        os._exit(0)
    env = json.loads(line)
    os.environ.clear()
    os.environ.update(env)
    held.release()


class _HeldOutput:
    """Standard output and error (the file descriptors, so library and C output too) sent to a temporary file
    until ``release``, which restores them and writes out what was held."""

    def __init__(self) -> None:
        self._saved = {}
        self._files = {}
        for fd, stream in ((1, sys.stdout), (2, sys.stderr)):
            stream.flush()
            self._files[fd] = tempfile.TemporaryFile()
            self._saved[fd] = os.dup(fd)
            os.dup2(self._files[fd].fileno(), fd)

    def release(self) -> None:
        for fd, stream in ((1, sys.stdout), (2, sys.stderr)):
            stream.flush()
            os.dup2(self._saved[fd], fd)
            os.close(self._saved[fd])
            held = self._files[fd]
            held.seek(0)
            with open(fd, "wb", closefd=False) as out:
                shutil.copyfileobj(held, out)
            held.close()
