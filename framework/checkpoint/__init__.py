"""Sharded checkpoints (``torch.distributed.checkpoint``): atomic saves, exact resume, verified export.

- ``store``: the on-disk format: layout, discovery, the newest complete checkpoint, verification.
- ``resume``: which checkpoint a run resumes from (``resolve_resume``), loading it (``load_sharded``).
- ``callback``: the Lightning ``CheckpointCallback`` (saves, ``keep_last``, resume) and its builder.
- ``safetensors_folder``: a Hugging Face safetensors folder written from the shards and read back exactly.
- ``export``: Hugging Face export of a full model, no process holding it, from the live run
  (``export_full_live``) or a checkpoint (``export_full_checkpoint``).
- ``adapter_export``: the package's ``export_live`` and ``export_checkpoint``: a PEFT run's (adapter dir, merged
  model), handing full models on to ``export``'s.
- ``inspect``: the ``shardlight inspect`` listing, from DCP metadata.
"""

from shardlight.checkpoint.adapter_export import export_checkpoint, export_live
from shardlight.checkpoint.callback import CheckpointCallback, build_checkpoint_callback, find_callback
from shardlight.checkpoint.inspect import format_inspect, inspect_checkpoint
from shardlight.checkpoint.resume import find_resume, load_sharded, resolve_resume

__all__ = [
    "CheckpointCallback", "build_checkpoint_callback", "find_callback",
    "find_resume", "load_sharded", "resolve_resume",
    "export_checkpoint", "export_live",
    "format_inspect", "inspect_checkpoint",
]
