"""Which modules become FSDP units (and which are the blocks to checkpoint), and the wrap report that says
whether that is a good idea. Shared by ``fsdp1``, ``fsdp2`` and the planner."""

from __future__ import annotations

import statistics
from typing import Dict, List, Optional

from torch import nn

from shardlight.errors import ShardlightError

GUIDELINE_MIN_PARAMS = 50_000_000
GUIDELINE_MAX_PARAMS = 200_000_000


def find_block_classes(model: nn.Module, names: Optional[List[str]]) -> List[type]:
    """Module classes to wrap, by name; no names → the HF model's ``_no_split_modules`` (as Accelerate does)."""
    if not names:
        names = []
        for module in model.modules():
            names.extend(getattr(module, "_no_split_modules", None) or [])
        if not names:
            raise ShardlightError(
                "fsdp.auto_wrap_policy TRANSFORMER_BASED_WRAP: the model declares no _no_split_modules; "
                "set fsdp.transformer_cls_names_to_wrap"
            )
    present = {type(m).__name__: type(m) for m in model.modules()}
    missing = [n for n in dict.fromkeys(names) if n not in present]
    wanted = [n for n in dict.fromkeys(names) if n in present]
    if missing and not wanted:
        raise ShardlightError(
            f"fsdp.transformer_cls_names_to_wrap: {', '.join(missing)} not found in the model; "
            f"module classes present: {', '.join(sorted(present))}"
        )
    return [present[n] for n in wanted]


def block_modules(model: nn.Module, names: Optional[List[str]]) -> List[nn.Module]:
    """Every instance of the block classes ``find_block_classes`` names, in ``model.modules()`` order."""
    classes = tuple(find_block_classes(model, names))
    return [m for m in model.modules() if isinstance(m, classes)]


def _own_numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters(recurse=False))


def size_based_units(root: nn.Module, min_num_params: int) -> List[nn.Module]:
    """The modules torch's ``size_based_auto_wrap_policy`` wraps: bottom-up, once the parameters not yet
    in a unit reach ``min_num_params`` (containers and the root itself excluded)."""
    units: List[nn.Module] = []

    def visit(module: nn.Module) -> int:
        remaining = _own_numel(module) + sum(visit(child) for child in module.children())
        wrappable = module is not root and not isinstance(module, (nn.ModuleList, nn.ModuleDict))
        if wrappable and remaining >= max(min_num_params, 1):
            units.append(module)
            return 0
        return remaining

    visit(root)
    return units


def unit_modules(model: nn.Module, auto_wrap_policy: str, class_names: Optional[List[str]],
                 min_num_params: Optional[int]) -> List[nn.Module]:
    """The non-root FSDP units, innermost first (the order ``fully_shard`` must see them)."""
    if auto_wrap_policy == "TRANSFORMER_BASED_WRAP":
        return block_modules(model, class_names)[::-1]
    if auto_wrap_policy == "SIZE_BASED_WRAP":
        return size_based_units(model, min_num_params or 0)
    return []


def tie_groups(model: nn.Module) -> List[List[str]]:
    """The names of each weight ``model`` holds under several names (``tie_word_embeddings``: the input
    embedding and the output head), in the model's order."""
    names: Dict[int, List[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def check_tied_weights(model: nn.Module, units: List[nn.Module]) -> None:
    """A weight tied between two units (a ``_no_split_modules`` class holding the embeddings that the head
    outside it shares) would be sharded by one unit and read whole by the other: refuse it, naming the unit
    classes that can be wrapped instead."""
    unit_names = {name: type(m).__name__ for name, m in model.named_modules() if any(m is u for u in units)}
    owners: Dict[int, Dict[str, str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        owner = max((u for u in unit_names if name == u or name.startswith(u + ".") or not u), key=len, default="")
        for param_name, param in module._parameters.items():
            if param is not None:
                owners.setdefault(id(param), {})[owner] = f"{name}.{param_name}".lstrip(".")
    for places in owners.values():
        if len(places) > 1:
            classes = sorted({unit_names.get(owner, "the root") for owner in places})
            keep = sorted(set(unit_names.values()) - set(classes))
            raise ShardlightError(
                f"fsdp.transformer_cls_names_to_wrap: {' and '.join(sorted(places.values()))} are one tied weight "
                f"in two FSDP units ({', '.join(classes)}) and FSDP cannot shard one weight in two; set "
                f"fsdp.transformer_cls_names_to_wrap: [{', '.join(keep)}]")


def wrap_report(model: nn.Module, units: List[nn.Module], tiny_unit_params: int = 1_000_000) -> Dict:
    """Units, parameters per unit and what to worry about; computed before sharding, so sizes are full."""
    unit_ids = {id(m) for m in units}
    sizes, trainable_sizes = [], []
    for unit in units:
        nested = {id(p) for m in unit.modules() if m is not unit and id(m) in unit_ids for p in m.parameters()}
        own = [p for p in unit.parameters() if id(p) not in nested]
        sizes.append(sum(p.numel() for p in own))
        trainable_sizes.append(sum(p.numel() for p in own if p.requires_grad))
    in_units = {id(p) for unit in units for p in unit.parameters()}
    root = [p for p in model.parameters() if id(p) not in in_units]
    root_params = sum(p.numel() for p in root)
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    warnings = []
    if not units:
        warnings.append(
            "a single FSDP unit: every all-gather covers the whole model and there is no compute to hide it "
            "behind; wrap transformer blocks (auto_wrap_policy: TRANSFORMER_BASED_WRAP)"
        )
    elif statistics.median(sizes) < tiny_unit_params:
        warnings.append(
            f"units are tiny (median {int(statistics.median(sizes)):,} params < {tiny_unit_params:,}): "
            "per-collective latency dominates; wrap larger modules"
        )
    report = {
        "units": len(units) + 1,
        "params_total": total,
        "params_per_unit": {
            "min": min(sizes) if sizes else 0,
            "median": int(statistics.median(sizes)) if sizes else 0,
            "max": max(sizes) if sizes else 0,
        },
        "root_params": root_params,
        # Adapters (peft) leave most of each unit frozen: no gradient, no optimizer state for those.
        "trainable_params_total": trainable,
        "frozen_params_total": total - trainable,
        "trainable_per_unit": _spread(trainable_sizes),
        "root_trainable_params": sum(p.numel() for p in root if p.requires_grad),
        "unit_class": sorted({type(u).__name__ for u in units}),
        "warnings": warnings,
        "guideline": f"large models: aim for {GUIDELINE_MIN_PARAMS // 1_000_000}-{GUIDELINE_MAX_PARAMS // 1_000_000}M "
                     "params per unit to amortize collective latency while keeping the all-gather buffer small",
    }
    return report


def _spread(sizes: List[int]) -> Dict[str, int]:
    return {"min": min(sizes) if sizes else 0, "median": int(statistics.median(sizes)) if sizes else 0,
            "max": max(sizes) if sizes else 0}


def format_wrap_report(report: Dict, strategy: str, world_size: int) -> str:
    per = report["params_per_unit"]
    line = (
        f"FSDP {strategy}: {report['units']} units on {world_size} ranks "
        f"({', '.join(report['unit_class']) or 'root only'}); params per unit min/median/max "
        f"{per['min']:,}/{per['median']:,}/{per['max']:,}, root {report['root_params']:,}"
    )
    if report.get("frozen_params_total"):
        trainable = report["trainable_per_unit"]
        line += (f"; trainable {report['trainable_params_total']:,} of {report['params_total']:,} "
                 f"({report['frozen_params_total']:,} frozen), trainable per unit min/median/max "
                 f"{trainable['min']:,}/{trainable['median']:,}/{trainable['max']:,}, "
                 f"root {report['root_trainable_params']:,}")
    if report.get("mesh"):
        mesh = " x ".join(f"{name} {size}" for name, size in report["mesh"].items())
        per_rank = report.get("params_per_rank") or [report["params_this_rank"]]
        line += f"; mesh {mesh}, params per rank min/max {min(per_rank):,}/{max(per_rank):,}"
    return line
