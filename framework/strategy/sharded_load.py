"""Pretrained weights straight into the shards, as torchtitan loads a Hugging Face checkpoint: every rank builds
the model with its parameters on the meta device (``build_skeleton``), the strategy shards it (FSDP1, FSDP2, TP
× FSDP2), gives this rank's shards memory (``materialize``) and reads this rank's slices of the safetensors files
into them (``load_safetensors``: DCP's ``HuggingFaceStorageReader``, which reads each slice with safetensors'
``get_slice``). FSDP1 can only shard a whole unit, so it reads each unit as it wraps it (``meta_param_init``).
No rank ever holds the full model: a rank's memory for the load is its shards (and, on FSDP1, one unit).

What a checkpoint does not hold stays as built: buffers computed at construction (rotary frequencies) are
built for real (accelerate's ``init_empty_weights(include_buffers=False)``), and PEFT adapters are made real
before sharding (``shardlight.adapters``), so the load fills exactly the meta parameters.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable, Collection, Dict, List, Optional, TypeVar

import torch
from torch import nn

from shardlight.errors import ShardlightError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# peft's names around a base model's tensors: the PeftModel/LoraModel prefix, the wrapped base layer, and the
# frozen original and trainable copy of a ``modules_to_save`` module. Each is the checkpoint's tensor.
PEFT_PREFIX = "base_model.model."
_PEFT_INFIX = re.compile(r"\.(base_layer|original_module|modules_to_save\.default)(?=\.)")

Built = TypeVar("Built")


def checkpoint_keys(folder: Path) -> Optional[Dict[str, str]]:
    """The tensor names of a Hugging Face safetensors checkpoint, each with the file that holds it (its index,
    or its one file's header); None when ``folder`` holds no safetensors (an old ``pytorch_model.bin``)."""
    index = folder / INDEX_FILE
    if index.is_file():
        return dict(json.loads(index.read_text())["weight_map"])
    single = folder / SINGLE_FILE
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), framework="pt") as f:
            return {key: SINGLE_FILE for key in f.keys()}
    return None


def file_key(name: str, prefix: str = "") -> str:
    """The checkpoint's name for the model's state-dict key ``name`` (under ``prefix``, the wrapper's own
    attribute path), without peft's wrapping names."""
    name = name.removeprefix(prefix).removeprefix(PEFT_PREFIX)
    return _PEFT_INFIX.sub("", name)


def build_skeleton(build: Callable[[], Built]) -> Built:
    """``build()`` with every parameter on the meta device and every buffer real, and weights tied again
    (accelerate's meta parameters are new objects, so the ties ``build`` made are lost)."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        model = build()
    _tie(model)
    return model


def _tie(model: nn.Module) -> None:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if hasattr(base, "tie_weights"):
        base.tie_weights()


def has_meta_parameters(model: nn.Module) -> bool:
    return any(_local(p).is_meta for p in model.parameters())


def unloaded_keys(model: nn.Module, keys: Collection[str]) -> List[str]:
    """The meta parameters of ``model`` (unwrapped) that no tensor of the checkpoint fills; tied parameters
    count as filled when one of their names is."""
    filled = {id(p) for name, p in model.named_parameters(remove_duplicate=False) if file_key(name) in keys}
    return [name for name, p in model.named_parameters() if p.is_meta and id(p) not in filled]


def meta_param_init(device: torch.device, model: nn.Module, folder: Optional[Path] = None,
                    prefix: str = "") -> Callable[[nn.Module], None]:
    """FSDP1's ``param_init_fn`` for the skeleton ``model``: storage on ``device`` for a module's meta
    parameters, filled from the checkpoint in ``folder`` (``prefix``: the HF model's attribute path in
    ``model``). FSDP1 calls it for one unit at a time and shards the unit before the next, so a rank holds its
    shards and one whole unit; each tensor is read with the file opened for it alone, so no file stays mapped.
    One new tensor per meta tensor, so tied weights stay tied; real tensors (buffers, adapters) are kept."""
    from safetensors import safe_open

    files = checkpoint_keys(folder) if folder is not None else {}
    keys = {id(p): file_key(name, prefix) for name, p in model.named_parameters(remove_duplicate=False)
            if file_key(name, prefix) in (files or {})}
    made: Dict[int, nn.Parameter] = {}

    def init(module: nn.Module) -> None:
        for name, param in list(module._parameters.items()):
            if param is None or not param.is_meta:
                continue
            if id(param) not in made:
                made[id(param)] = new = nn.Parameter(torch.empty_like(param, device=device),
                                                     requires_grad=param.requires_grad)
                key = keys.get(id(param))
                if key is not None:
                    with safe_open(str(folder / files[key]), framework="pt") as f, torch.no_grad():
                        new.copy_(f.get_tensor(key))
            module._parameters[name] = made[id(param)]

    return init


def materialize(model: nn.Module, device: torch.device) -> None:
    """Give the sharded (FSDP2) ``model``'s meta shards empty storage on ``device``. ``to_empty`` is the way
    FSDP2 re-points its sharded parameters; it empties every tensor, so the real ones (buffers, adapters) are
    copied back, and ties made again (it makes one tensor per module)."""
    real = {name: t.detach().clone() for name, t in _tensors(model) if not _local(t).is_meta}
    model.to_empty(device=device)
    with torch.no_grad():
        for name, t in _tensors(model):
            if name in real:
                t.copy_(real[name])
    _tie(model)


def _tensors(model: nn.Module):
    yield from model.named_parameters()
    yield from model.named_buffers()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def load_safetensors(root: nn.Module, folder: Path) -> int:
    """Read this rank's slices of the checkpoint in ``folder`` into the sharded ``root`` (every rank calls
    it; ``root`` is the Hugging Face model, sharded). Returns the number of tensors read. Two parameters
    named by one tensor (peft's ``modules_to_save`` original and copy) both get it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    keys = checkpoint_keys(folder) or {}
    state = get_model_state_dict(root)
    targets: Dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if file_key(name) in keys:
            targets.setdefault(file_key(name), tensor)
    if not targets:
        raise ShardlightError(f"model.name_or_path: {folder} holds none of the model's tensors")
    dcp.load(targets, storage_reader=HuggingFaceStorageReader(str(folder)))
    loaded = {name: targets[file_key(name)] for name in state if file_key(name) in targets}
    set_model_state_dict(root, loaded, options=StateDictOptions(strict=False))
    return len(targets)


def load_host_bytes(total: int, largest_read: int, shard_ranks: int, *, sharded: bool, on_gpu: bool) -> int:
    """Host memory one rank needs to load a checkpoint of ``total`` bytes. Sharded: its share of the weights
    (on CPU; on a GPU the shards live in device memory) plus what it reads whole before it shards it,
    ``largest_read`` (one FSDP1 unit, or on FSDP2/TP the largest tensor). Not sharded (``from_pretrained`` on
    every rank): the whole model, which it builds on the host before any device sees it."""
    if not sharded:
        return total
    return largest_read + (0 if on_gpu else -(-total // shard_ranks))


def largest_read_bytes(model: nn.Module, unit_classes: tuple = ()) -> int:
    """What a rank of a sharded load reads whole at once: with ``unit_classes`` (FSDP1's wrapped blocks) the
    largest unit, the root's own weights being one; without, the largest tensor. Tied weights count once."""
    sizes = {id(p): p.numel() * p.element_size() for p in model.parameters()}
    if not unit_classes:
        return max(sizes.values(), default=0)
    units = [sum(p.numel() * p.element_size() for p in m.parameters()) for m in model.modules()
             if isinstance(m, unit_classes)]
    return max(units + [sum(sizes.values()) - sum(units)])
