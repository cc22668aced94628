"""``--accelerate-config``: every key the installed Accelerate can write is in ``shardlight.recipe.accelerate.KEYS``
(mapped, ignored on purpose or refused), files modelled on Accelerate's own examples load with their meaning,
and what shardlight cannot honour is one line naming the key."""

import dataclasses
import re
import typing
from pathlib import Path

import pytest
import yaml
from conftest import run_cli

from shardlight.cli.main import main
from shardlight.errors import ShardlightError
from shardlight.recipe import load_recipe
from shardlight.recipe.accelerate import KEYS, Refused, accelerate_config_overrides, section_of
from shardlight.recipe.schema import RecipeConfig


def _accelerate_source(relative: str) -> str:
    import accelerate

    return (Path(accelerate.__file__).parent / relative).read_text()


def _questionnaire_keys():
    """The keys ``accelerate config`` writes into fsdp_config and parallelism_config."""
    source = _accelerate_source("commands/config/cluster.py")
    return set(re.findall(r'fsdp_config\["(\w+)"\]\s*=', source)) | {
        f"parallelism_config_{name}" for name in re.findall(r'parallelism_config\[prefix \+ "(\w+)"\]\s*=', source)}


def _launch_keys():
    """The fsdp_* and parallelism_config_* settings ``accelerate launch`` takes from a config file."""
    source = _accelerate_source("commands/launch.py") + _accelerate_source("utils/launch.py")
    return set(re.findall(r'"--((?:fsdp|parallelism_config)_\w+)"', source)) | set(
        re.findall(r'args, "(fsdp_\w+)"', source))


def _cluster_config_fields():
    from accelerate.commands.config.config_args import ClusterConfig

    return {f.name for f in dataclasses.fields(ClusterConfig)}  # BaseConfig's fields included


def _fsdp_plugin_fields():
    from accelerate.utils import FullyShardedDataParallelPlugin

    return {f.name if f.name.startswith("fsdp_") else f"fsdp_{f.name}"
            for f in dataclasses.fields(FullyShardedDataParallelPlugin)}


def _parallelism_config_fields():
    from accelerate.parallelism_config import ParallelismConfig

    return {f"parallelism_config_{f.name}" for f in dataclasses.fields(ParallelismConfig)}


SOURCES = {
    "accelerate config questionnaire": (_questionnaire_keys, 10),
    "accelerate launch arguments": (_launch_keys, 20),
    "ClusterConfig fields": (_cluster_config_fields, 25),
    "FullyShardedDataParallelPlugin fields": (_fsdp_plugin_fields, 18),
    "ParallelismConfig fields": (_parallelism_config_fields, 6),
}


@pytest.mark.parametrize("source", SOURCES)
def test_every_accelerate_key_is_mapped_ignored_or_refused(source):
    collect, at_least = SOURCES[source]
    keys = collect()
    assert len(keys) >= at_least, f"{source}: the parse found only {sorted(keys)}; has Accelerate's source moved?"
    missing = sorted(keys - set(KEYS))
    assert not missing, f"{source}: new Accelerate keys; map, ignore or refuse each in KEYS: {missing}"


def test_the_table_is_well_formed():
    """Each entry: a recipe key that exists, a section, 'ignored: why', or a refusal with its reason."""
    sections = typing.get_type_hints(RecipeConfig)
    for key, rule in KEYS.items():
        if isinstance(rule, Refused):
            assert rule.why, key
        elif rule.startswith("ignored: "):
            assert len(rule) > len("ignored: ") + 10, key
        elif "." in rule:
            section, name = rule.split(".")
            assert name in {f.name for f in dataclasses.fields(sections[section])}, (key, rule)
        else:
            assert key in ("fsdp_config", "parallelism_config") and rule in sections, (key, rule)


def _write(tmp_path, data, name="acc.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data) if isinstance(data, dict) else data)
    return str(path)


def _placed(key, value, base=None):
    """A minimal FSDP file with ``key: value`` in its section (parallelism_config needs FSDP2)."""
    data = {"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 2}, **(base or {})}
    section = section_of(key)
    if section:
        data.setdefault(section, {})[key] = value
    else:
        data[key] = value
    return data


def _bad(harmless):
    """A value that asks for something: not null and not one of ``harmless``."""
    if not harmless:
        return "something"
    first = harmless[0]
    if isinstance(first, bool):
        return not first
    if isinstance(first, int):
        return first + 1
    if isinstance(first, dict):
        return {name: "INDUCTOR" for name in first}
    return "OTHER"


REFUSED = sorted(k for k, rule in KEYS.items() if isinstance(rule, Refused))


@pytest.mark.parametrize("key", REFUSED)
def test_refused_key_is_one_line_naming_it_unless_null_or_harmless(tmp_path, key):
    rule = KEYS[key]
    for fine in (None, *rule.harmless):
        accelerate_config_overrides(_write(tmp_path, _placed(key, fine)))
    path = _write(tmp_path, _placed(key, _bad(rule.harmless)))
    with pytest.raises(ShardlightError) as err:
        accelerate_config_overrides(path)
    message = str(err.value)
    assert len(message.splitlines()) == 1 and message.startswith(f"accelerate config {path}: {key} is "), message
    assert rule.why in message and "; allowed: " in message, message


IGNORED = sorted(k for k, rule in KEYS.items() if isinstance(rule, str) and rule.startswith("ignored: "))


@pytest.mark.parametrize("key", IGNORED)
def test_ignored_key_has_no_effect(tmp_path, key):
    baseline = accelerate_config_overrides(_write(tmp_path, _placed(key, None)))
    assert accelerate_config_overrides(_write(tmp_path, _placed(key, "some-value"))) == baseline


# Modelled on Accelerate's examples/config_yaml_templates/fsdp.yaml (FSDP1), as `accelerate config` writes it.
FSDP1 = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: FSDP
downcast_bf16: 'no'
enable_cpu_affinity: false
fsdp_config:
  fsdp_activation_checkpointing: false
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_backward_prefetch: BACKWARD_PRE
  fsdp_cpu_ram_efficient_loading: true
  fsdp_forward_prefetch: false
  fsdp_ignored_modules: null
  fsdp_offload_params: false
  fsdp_reshard_after_forward: FULL_SHARD
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_sync_module_states: true
  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer
  fsdp_use_orig_params: true
  fsdp_version: 1
machine_rank: 0
main_process_ip: null
main_process_port: null
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""
# Modelled on Accelerate's examples/torch_native_parallelism/configs/tp_hsdp.yaml: FSDP2 + TP + HSDP.
FSDP2_TP_HSDP = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: FSDP
downcast_bf16: 'no'
enable_cpu_affinity: false
fsdp_config:
  fsdp_activation_checkpointing: false
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_cpu_ram_efficient_loading: false
  fsdp_offload_params: false
  fsdp_reshard_after_forward: true
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_version: 2
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 8
parallelism_config:
  parallelism_config_cp_size: 1
  parallelism_config_dp_replicate_size: 2
  parallelism_config_dp_shard_size: 2
  parallelism_config_tp_size: 2
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""
# The same without TP: HSDP over (replicate 2, shard 4), which is fsdp: HYBRID_SHARD in a recipe.
FSDP2_HSDP = FSDP2_TP_HSDP.replace("dp_shard_size: 2", "dp_shard_size: 4").replace("tp_size: 2", "tp_size: 1")
# Modelled on Accelerate's tests/distributed/accelerate_configs/fsdp2.yaml: the smallest FSDP2 file.
FSDP2_MINIMAL = "compute_environment: LOCAL_MACHINE\ndistributed_type: FSDP\nnum_machines: 1\nnum_processes: 2\n" \
                "fsdp_config:\n  fsdp_version: 2\n"

EXAMPLES = {
    "fsdp1": (FSDP1, {"fsdp_version": 1, "sharding_strategy": "FULL_SHARD", "backward_prefetch": "BACKWARD_PRE",
                      "state_dict_type": "SHARDED_STATE_DICT", "transformer_cls_names_to_wrap": ["LlamaDecoderLayer"]},
              {"devices": 2, "precision": "bf16-mixed"}, None),
    "fsdp2_tp_hsdp": (FSDP2_TP_HSDP, {"fsdp_version": 2, "reshard_after_forward": True},
                      {"devices": 8, "num_nodes": 1}, (2, 2, 2)),
    "fsdp2_hsdp": (FSDP2_HSDP, {"sharding_strategy": "HYBRID_SHARD", "mesh_shape": [2, 4]}, {"devices": 8}, None),
    "fsdp2_minimal": (FSDP2_MINIMAL, {"fsdp_version": 2}, {"devices": 2, "num_nodes": 1}, None),
}


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_files_load_with_their_meaning(tmp_path, capsys, name):
    from shardlight.strategy import resolve_recipe_fsdp

    text, fsdp, trainer, mesh = EXAMPLES[name]
    path = _write(tmp_path, text, f"{name}.yaml")
    assert main(["train", "--accelerate-config", path, "--print-config"]) == 0
    resolved = yaml.safe_load(capsys.readouterr().out)
    assert {k: resolved["fsdp"][k] for k in fsdp} == fsdp
    assert {k: resolved["trainer"][k] for k in trainer} == trainer
    plan = resolve_recipe_fsdp(load_recipe(None, accelerate_config=path))
    assert (plan.parallel.shape if plan.parallel else None) == mesh
    if name == "fsdp2_tp_hsdp":
        assert (resolved["parallelism"]["dp_replicate_size"], resolved["parallelism"]["dp_shard_size"],
                resolved["parallelism"]["tp_size"]) == (2, 2, 2)
    if name == "fsdp2_hsdp":
        assert plan.hybrid and plan.mesh_shape == (2, 4) and plan.reshard_after_forward is True


def test_context_parallelism_is_refused_in_one_line_by_the_cli(tmp_path):
    # Accelerate's examples/torch_native_parallelism/configs/nd.yaml asks for cp_size 4.
    path = _write(tmp_path, FSDP2_TP_HSDP.replace("cp_size: 1", "cp_size: 2"))
    result = run_cli(["train", "--accelerate-config", path, "--print-config"])
    err = result.stderr.strip()
    assert result.returncode == 2 and len(err.splitlines()) == 1, err
    assert err == (f"error: accelerate config {path}: parallelism_config_cp_size is 2: context parallelism is not "
                   "supported yet; allowed: 1, null")


def test_ignored_modules_null_is_not_set(tmp_path):
    path = _write(tmp_path, FSDP2_MINIMAL + "  fsdp_ignored_modules: null\n")
    assert main(["train", "--accelerate-config", path, "--print-config"]) == 0
    path = _write(tmp_path, FSDP2_MINIMAL + "  fsdp_ignored_modules: lm_head\n")
    with pytest.raises(ShardlightError, match="fsdp_ignored_modules is lm_head: every module is sharded"):
        load_recipe(None, accelerate_config=path)


# fsdp_config snippet → expected recipe fsdp: values (Accelerate's spellings of one meaning).
SPELLINGS = [
    ({"fsdp_reshard_after_forward": "SHARD_GRAD_OP"}, {"sharding_strategy": "SHARD_GRAD_OP"}),
    ({"fsdp_version": 1, "fsdp_reshard_after_forward": "HYBRID_SHARD_ZERO2"},
     {"fsdp_version": 1, "sharding_strategy": "_HYBRID_SHARD_ZERO2"}),
    ({"fsdp_sharding_strategy": 2}, {"sharding_strategy": "SHARD_GRAD_OP"}),
    ({"sharding_strategy": "NO_SHARD", "fsdp_reshard_after_forward": "FULL_SHARD"}, {"sharding_strategy": "NO_SHARD"}),
    ({"fsdp_version": "2", "fsdp_reshard_after_forward": "false"}, {"fsdp_version": 2, "reshard_after_forward": False}),
    ({"fsdp_version": 2, "fsdp_reshard_after_forward": "no", "fsdp_forward_prefetch": "false"},
     {"fsdp_version": 2, "reshard_after_forward": False}),
    ({"fsdp_version": 2, "fsdp_backward_prefetch": "BACKWARD_PRE", "fsdp_use_orig_params": True,
      "fsdp_sync_module_states": True, "fsdp_forward_prefetch": False, "fsdp_sharding_strategy": "FULL_SHARD"},
     {"fsdp_version": 2}),
]


@pytest.mark.parametrize("fsdp_config,expected", SPELLINGS, ids=[str(s[0])[:50] for s in SPELLINGS])
def test_accelerate_spellings(tmp_path, fsdp_config, expected):
    path = _write(tmp_path, {"distributed_type": "FSDP", "fsdp_config": fsdp_config})
    assert accelerate_config_overrides(path)["fsdp"] == expected


# parallelism_config (FSDP2, 8 ranks) → the recipe's fsdp: and parallelism: values it becomes.
MESHES = [
    ({"parallelism_config_dp_replicate_size": 1, "parallelism_config_dp_shard_size": 1,  # the questionnaire's
      "parallelism_config_tp_size": 1, "parallelism_config_cp_size": 1}, {"fsdp_version": 2}, None),  # defaults
    ({"parallelism_config_dp_shard_size": 8}, {"fsdp_version": 2}, None),
    ({"parallelism_config_dp_replicate_size": 4}, {"fsdp_version": 2, "sharding_strategy": "HYBRID_SHARD",
                                                   "mesh_shape": [4, 2]}, None),
    ({"parallelism_config_tp_size": 4}, {"fsdp_version": 2}, {"tp_size": 4}),
]


@pytest.mark.parametrize("parallelism_config,fsdp,parallelism", MESHES, ids=[str(m[0])[:60] for m in MESHES])
def test_accelerate_meshes(tmp_path, parallelism_config, fsdp, parallelism):
    path = _write(tmp_path, {"distributed_type": "FSDP", "num_processes": 8, "fsdp_config": {"fsdp_version": 2},
                             "parallelism_config": parallelism_config})
    out = accelerate_config_overrides(path)
    assert (out["fsdp"], out.get("parallelism")) == (fsdp, parallelism)


# A file (as a dict) → the text its one-line refusal contains.
REFUSALS = [
    ({"distributed_type": "DEEPSPEED", "deepspeed_config": {"zero_stage": 3}}, "distributed_type is DEEPSPEED"),
    ({"distributed_type": "MULTI_GPU"}, "distributed_type is MULTI_GPU: shardlight runs FSDP; allowed: FSDP, null"),
    ({"distributed_type": "NO"}, "distributed_type is NO"),
    ({"mixed_precision": "fp8"}, "mixed_precision is fp8: not supported; allowed: no, bf16, fp16"),
    ({"num_processes": 3, "num_machines": 2}, "num_processes is 3: not a positive multiple of num_machines 2"),
    ({"num_proceses": 2}, "num_proceses is 2: not a key Accelerate writes; did you mean 'num_processes'?"),
    ({"fsdp_config": {"fsdp_sharding_stratgy": "FULL_SHARD"}}, "did you mean 'fsdp_sharding_strategy'"),
    ({"fsdp_config": {"fsdp_state_dict_type": "LOCAL_STATE_DICT"}},
     "fsdp_state_dict_type is LOCAL_STATE_DICT: shardlight does not support this value; allowed: FULL_STATE_DICT"),
    ({"fsdp_config": {"fsdp_version": 2, "fsdp_sharding_strategy": "HYBRID_SHARD"}},
     "fsdp_sharding_strategy is HYBRID_SHARD: Accelerate ignores it with fsdp_version 2"),
    ({"fsdp_config": {"fsdp_version": 2, "fsdp_forward_prefetch": True}}, "fsdp_forward_prefetch is true: not implemented in FSDP2"),
    ({"fsdp_config": {"fsdp_version": 1}, "parallelism_config": {"parallelism_config_tp_size": 2}},
     "parallelism_config is set: Accelerate reads it only with fsdp_version 2"),
    ({"fsdp_config": {"fsdp_version": 2}, "num_processes": 8,
      "parallelism_config": {"parallelism_config_dp_replicate_size": 2, "parallelism_config_dp_shard_size": 2}},
     "parallelism_config_dp_shard_size is 2: dp_replicate_size 2 x it is not num_processes 8"),
    ({"parallelism_config": {"tp_size": 2}}, "parallelism_config.tp_size is 2: not a key Accelerate writes there"),
]


@pytest.mark.parametrize("data,expected", REFUSALS, ids=[r[1][:40] for r in REFUSALS])
def test_refusals(tmp_path, data, expected):
    path = _write(tmp_path, {"distributed_type": "FSDP", **data})
    with pytest.raises(ShardlightError) as err:
        accelerate_config_overrides(path)
    assert expected in str(err.value) and len(str(err.value).splitlines()) == 1, str(err.value)
