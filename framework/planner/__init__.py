"""Choosing the sharding strategy, as a library (``shardlight.cli.planner_command`` is its command line).

* ``model_spec``: a Hugging Face config on the meta device → ``ModelSpec`` (parameters, blocks, FSDP units);
* ``inputs``: ``Cluster``, ``Workload`` and the tables they are made from;
* ``memory_estimate``: per-rank bytes of one configuration (``Layout``, ``Memory``); ``estimate``: its
  per-step seconds (communication, compute, the backward tail) and the whole ``Estimate``; ``STRATEGIES``;
* ``fake_step``: one training step of the real model on fake tensors over a fake process group, its per-rank
  memory by FSDPMemTracker; ``measured``: those steps as the plan's peaks (the analytic ones kept alongside);
* ``recommend``: the decision among the estimates, with reasons (and wrap-granularity advice);
* ``plan``: ``plan_for(spec, cluster, workload, restrict_ckpt, restrict_offload)`` (``shardlight plan``) and
  its typed inputs ``ClusterOptions``/``WorkloadOptions``, recipe → spec/workload, ``render``;
* ``sweep``: ``profile(ProfileRequest)`` (``shardlight profile``), a measured sweep of strategies;
  ``runs``: one sweep run (a ``shardlight train`` subprocess) and its metrics; ``sweep_report``: its files.

Nothing here imports ``shardlight.cli`` or ``shardlight.train``: the planner is an instrument over the core.
"""
