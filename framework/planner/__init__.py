"""Choosing the sharding strategy, as a library (``shardlight.cli.planner`` is its command line).

* ``model_spec``: a Hugging Face config on the meta device → ``ModelSpec`` (parameters, blocks, FSDP units);
* ``estimate``: per-rank bytes and per-step seconds of one configuration; ``Cluster``, ``Workload``, the
  names the planner knows (``STRATEGIES``, ``OPTIMIZERS``, ``PRECISIONS``);
* ``recommend``: the decision among the estimates, with reasons;
* ``plan``: ``plan_for(spec, cluster, workload, restrict_ckpt, restrict_offload)`` (``shardlight plan``) and
  its typed inputs ``ClusterOptions``/``WorkloadOptions``, recipe → spec/workload, ``render``;
* ``profile``: ``profile(ProfileRequest, hf_config_for=...)`` (``shardlight profile``), a measured sweep;
  ``runs``: one sweep run (a ``shardlight train`` subprocess) and its metrics; ``report``: its files.

Nothing here imports ``shardlight.cli``, ``shardlight.train`` or ``shardlight.build``.
"""
