"""Choosing the sharding strategy, as a library (``shardlight.cli.planner`` is its command line).

* ``model_spec``: a Hugging Face config on the meta device → ``ModelSpec`` (parameters, blocks, FSDP units);
* ``estimate``: per-rank bytes and per-step seconds of one configuration; ``Cluster``, ``Workload``, the
  names the planner knows (``STRATEGIES``, ``OPTIMIZERS``, ``PRECISIONS``);
* ``fake_step``: one training step of the real model on fake tensors over a fake process group, its per-rank
  memory by FSDPMemTracker; ``measured``: those steps as the plan's peaks (the analytic ones kept alongside);
* ``backward_tail``: the gradient collective after backward's last compute, charged alike to DDP and FSDP;
* ``recommend``: the decision among the estimates, with reasons (and wrap-granularity advice);
* ``plan``: ``plan_for(spec, cluster, workload, restrict_ckpt, restrict_offload)`` (``shardlight plan``) and
  its typed inputs ``ClusterOptions``/``WorkloadOptions``, recipe → spec/workload, ``render``;
* ``profile``: ``profile(ProfileRequest, hf_config_for=...)`` (``shardlight profile``), a measured sweep;
  ``runs``: one sweep run (a ``shardlight train`` subprocess) and its metrics; ``report``: its files.

Nothing here imports ``shardlight.cli``, ``shardlight.train`` or ``shardlight.build``.
"""
