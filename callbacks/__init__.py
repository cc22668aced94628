"""The run's Lightning callbacks, one module per concern.

The training core's own (``shardlight.build`` adds them): ``preemption`` (checkpoint and requeue on a signal),
``peer_failure`` (a dead or hung peer as one clear line), ``gc_freeze``, ``progress`` (the step bar).

The measuring callbacks, instruments the CLI plugs into a run (``shardlight.instruments``; ``registry`` builds
them from the recipe's ``callbacks:`` section):

* ``comm`` (``CommTimeCallback``): communication vs compute time, from short profiler windows;
* ``memory`` (``MemoryHeadroomCallback``): memory headroom and the local shard's bytes per rank;
* ``throughput`` (``ThroughputCallback``): tokens/s per device, MFU, scaling efficiency;
* ``rank_table`` (``RankTableCallback``): the end-of-run per-rank table, added after the others whenever any is
  enabled;
* ``_common``: what they share (``Shared``, the ``RankTable``, gathering and logging helpers).

Everything is logged by rank 0 through the trainer's Lightning loggers (W&B and the CSV twin); see each
module's docstring for its metrics. This package's ``__init__`` imports nothing, so the core's callbacks load
without the instruments.
"""
