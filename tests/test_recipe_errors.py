"""Recipe-level bad input through the real CLI entry point: one ``error: `` line, exit code 2, no traceback,
nothing written. Also: a scalar for any list-typed key, ``base:`` lookup, a UTF-8 byte-order mark, and the
rule that every numeric setting of the schema has a checked range."""

import dataclasses
import json
import re
import typing

import pytest
from conftest import DEFAULT_RECIPE, forbid_training

from shardlight.cli.main import main
from shardlight.errors import ShardlightError
from shardlight.recipe import RECIPES_DIR, RecipeConfig, get_key, load_recipe
from shardlight.recipe.load import _conform
from shardlight.recipe.validate import RANGE_RULES, RULES, schema_fields

BOM = b"\xef\xbb\xbf"
ROWS = "".join(json.dumps({"prompt": f"Add: {i} + 1", "response": str(i + 1)}) + "\n" for i in range(8))
CSV_ROWS = "prompt,response\n" + "".join(f"Add: {i} + 1,{i + 1}\n" for i in range(8))
# Caught only after the data checks, by the model's limits: a case ending here got past everything before.
SEQ_LEN_TOO_LONG = "data.seq_len=4096"
PAST_DATA_CHECKS = "exceeds the model's maximum positions (512)"

# (id, files to write under tmp (text or bytes; "recipe.yaml" is the one run, else the default recipe),
#  overrides, the message fragment). In files, overrides and fragments, {tmp} is the test's directory,
#  {recipe} the recipe file run, {shipped} the shipped recipes' directory. The run's cwd is {tmp}, outside
#  the repository.
CASES = [
    # A scalar for a list-typed key is a one-item list; positive cases end at a later, unrelated check.
    ("scalar_train_files_override", {"rows.jsonl": ROWS},
     ["data.train_files={tmp}/rows.jsonl", "data.val_files={tmp}/rows.jsonl", SEQ_LEN_TOO_LONG], PAST_DATA_CHECKS),
    ("scalar_train_files_in_recipe_is_relative_to_it",
     {"sub/recipe.yaml": f"base: {DEFAULT_RECIPE}\ndata:\n  train_files: missing.jsonl\n"}, [],
     "data file not found: {tmp}/sub/missing.jsonl"),
    ("scalar_betas_is_a_one_item_list", {}, ["optim.betas=0.9"], "optim.betas must have 2 items, got [0.9]"),
    ("scalar_mesh_shape_is_a_one_item_list", {}, ["fsdp.mesh_shape=2"], "fsdp.mesh_shape must have 2 items, got [2]"),
    # Other type mismatches name the key, the value and the expected type.
    ("mapping_for_a_list", {}, ["data.train_files={a: 1}"],
     "recipe key 'data.train_files' in command-line overrides: expected a list of strings, got {'a': 1}"),
    ("null_for_a_list", {}, ["data.train_files=null"],
     "recipe key 'data.train_files' in command-line overrides: expected a list of strings, got null"),
    ("list_for_an_integer", {}, ["trainer.max_steps=[3]"],
     "recipe key 'trainer.max_steps' in command-line overrides: expected an integer, got [3]"),
    ("text_for_an_integer", {}, ["trainer.micro_batch_size=eight"],
     "recipe key 'trainer.micro_batch_size' in command-line overrides: expected an integer, got 'eight'"),
    ("fraction_for_an_integer", {}, ["trainer.max_steps=2.5"],
     "recipe key 'trainer.max_steps' in command-line overrides: expected an integer, got 2.5"),
    ("text_for_a_number", {}, ["optim.lr=fast"],
     "recipe key 'optim.lr' in command-line overrides: expected a number, got 'fast'"),
    ("text_for_a_bool", {}, ["trainer.progress_bar=maybe"],
     "recipe key 'trainer.progress_bar' in command-line overrides: expected true or false, got 'maybe'"),
    ("number_for_a_bool", {}, ["fsdp.cpu_offload=2"],
     "recipe key 'fsdp.cpu_offload' in command-line overrides: expected true or false, got 2"),
    ("bad_list_item", {}, ["optim.betas=[0.9,high]"],
     "recipe key 'optim.betas[1]' in command-line overrides: expected a number, got 'high'"),
    ("list_as_a_list_item", {}, ["data.train_files=[[a.jsonl]]"],
     "recipe key 'data.train_files[0]' in command-line overrides: expected a string, got ['a.jsonl']"),
    ("scalar_for_a_mapping", {}, ["launch.env=NCCL_DEBUG"],
     "recipe key 'launch.env' in command-line overrides: expected a mapping of names to strings, got 'NCCL_DEBUG'"),
    ("bad_mapping_value", {}, ["callbacks.throughput.peak_tflops_table={A100: fast}"],
     "recipe key 'callbacks.throughput.peak_tflops_table.A100' in command-line overrides: expected a number, "
     "got 'fast'"),
    ("type_mismatch_in_a_recipe_file", {"recipe.yaml": f"base: {DEFAULT_RECIPE}\ntrainer:\n  max_steps: lots\n"},
     [], "recipe key 'trainer.max_steps' in {recipe}: expected an integer, got 'lots'"),
    ("list_for_a_string_in_a_recipe_file", {"recipe.yaml": f"base: {DEFAULT_RECIPE}\nmodel:\n  dtype: [bfloat16]\n"},
     [], "recipe key 'model.dtype' in {recipe}: expected a string, got ['bfloat16']"),
    # Every numeric setting has a range.
    ("peak_tflops_negative", {}, ["callbacks.throughput.peak_tflops=-1"],
     "callbacks.throughput.peak_tflops must be positive, got -1.0"),
    ("peak_tflops_table_negative", {}, ["callbacks.throughput.peak_tflops_table={A100: -5}"],
     "callbacks.throughput.peak_tflops_table.A100 must be positive, got -5.0"),
    ("limit_val_batches_negative", {}, ["trainer.limit_val_batches=-3"],
     "trainer.limit_val_batches must not be negative, got -3"),
    ("val_fraction_one", {}, ["data.val_fraction=1"], "data.val_fraction must be in [0, 1), got 1.0"),
    ("beta_one", {}, ["optim.betas=[0.9,1.0]"], "optim.betas[1] must be in [0, 1), got 1.0"),
    ("min_lr_ratio_above_one", {}, ["optim.min_lr_ratio=1.5"], "optim.min_lr_ratio must be between 0 and 1, got 1.5"),
    ("seed_negative", {}, ["trainer.seed=-1"], "trainer.seed must be between 0 and 4294967295, got -1"),
    ("seed_above_uint32", {}, ["trainer.seed=4294967296"], "trainer.seed must be between 0 and 4294967295"),
    ("gradient_clip_zero", {}, ["trainer.gradient_clip_val=0"], "trainer.gradient_clip_val must be positive, got 0.0"),
    ("num_threads_zero", {}, ["trainer.num_threads=0"], "trainer.num_threads must be positive, got 0"),
    ("mesh_shape_zero", {}, ["fsdp.mesh_shape=[2,0]"], "fsdp.mesh_shape[1] must be positive, got 0"),
    ("min_num_params_negative", {}, ["fsdp.min_num_params=-1"], "fsdp.min_num_params must not be negative, got -1"),
    ("tiny_unit_params_negative", {}, ["fsdp.wrap_report_tiny_unit_params=-5"],
     "fsdp.wrap_report_tiny_unit_params must not be negative, got -5"),
    ("comm_first_step_negative", {}, ["callbacks.comm.first_step=-2"],
     "callbacks.comm.first_step must not be negative, got -2"),
    ("comm_keep_windows_negative", {}, ["callbacks.comm.keep_windows=-1"],
     "callbacks.comm.keep_windows must not be negative, got -1"),
    ("eps_negative", {}, ["optim.eps=-1e-9"], "optim.eps must not be negative"),
    # base: beside the recipe, then the shipped recipes (with or without recipes/), then the current directory.
    ("base_shipped_with_recipes_prefix", {"recipe.yaml": "base: recipes/tiny-llama-sft.yaml\n"},
     ["trainer.max_steps=0"], "trainer.max_steps must be positive, got 0"),
    ("base_shipped_by_name", {"recipe.yaml": "base: tiny-llama-sft.yaml\n"},
     ["trainer.max_steps=0"], "trainer.max_steps must be positive, got 0"),
    ("base_beside_the_recipe_wins",
     {"sub/recipe.yaml": "base: tiny-llama-sft.yaml\n",
      "sub/tiny-llama-sft.yaml": "base: recipes/tiny-llama-sft.yaml\ntrainer:\n  max_steps: -4\n"},
     [], "trainer.max_steps must be positive, got -4"),
    ("base_in_the_current_directory",
     {"sub/recipe.yaml": "base: parent.yaml\n",
      "parent.yaml": "base: recipes/tiny-llama-sft.yaml\ntrainer:\n  micro_batch_size: 0\n"},
     [], "trainer.micro_batch_size must be positive, got 0"),
    ("base_missing_says_where_it_looked", {"sub/recipe.yaml": "base: recipes/nothere.yaml\n"}, [],
     "base recipe 'recipes/nothere.yaml' named in {recipe} not found; looked for "
     "{tmp}/sub/recipes/nothere.yaml (beside the recipe), {shipped}/nothere.yaml (shipped recipes), "
     "{tmp}/recipes/nothere.yaml (current directory)"),
    ("base_on_the_command_line", {}, ["base=tiny-llama-sft.yaml"], "base cannot be set on the command line"),
    # A UTF-8 byte-order mark is accepted (the run ends at the later seq_len check, not at the data).
    ("bom_jsonl_accepted", {"rows.jsonl": BOM + ROWS.encode()},
     ["data.train_files={tmp}/rows.jsonl", "data.val_files={tmp}/rows.jsonl", SEQ_LEN_TOO_LONG], PAST_DATA_CHECKS),
    ("bom_json_accepted", {"rows.json": BOM + json.dumps([json.loads(r) for r in ROWS.splitlines()]).encode()},
     ["data.train_files={tmp}/rows.json", "data.val_files={tmp}/rows.json", SEQ_LEN_TOO_LONG], PAST_DATA_CHECKS),
    ("bom_csv_accepted", {"rows.csv": BOM + CSV_ROWS.encode()},
     ["data.train_files={tmp}/rows.csv", "data.val_files={tmp}/rows.csv", SEQ_LEN_TOO_LONG], PAST_DATA_CHECKS),
]


def _fill(text: str, tmp, recipe: str) -> str:
    # str.replace, not str.format: overrides carry YAML braces ({A100: -5}).
    return text.replace("{tmp}", str(tmp)).replace("{recipe}", recipe).replace("{shipped}", str(RECIPES_DIR))


@pytest.mark.parametrize("name,files,overrides,expected", CASES, ids=[c[0] for c in CASES])
def test_bad_recipe_input_is_one_line_before_anything_is_written(tmp_path, capfd, monkeypatch,
                                                                name, files, overrides, expected):
    forbid_training(monkeypatch)
    monkeypatch.chdir(tmp_path)  # outside the repository, as a user's recipe would be
    recipe = str(DEFAULT_RECIPE)
    for relative, content in files.items():
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(_fill(content, tmp_path, ""))
        if path.name == "recipe.yaml":
            recipe = str(path)
    out_dir = tmp_path / "out"
    code = main(["train", recipe, f"output_dir={out_dir}", *[_fill(o, tmp_path, recipe) for o in overrides]])
    captured = capfd.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 2, captured.err
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    assert _fill(expected, tmp_path, recipe) in lines[0]
    assert "Traceback" not in captured.out + captured.err
    assert not out_dir.exists(), "nothing may be written before the input is valid"


def test_the_table_covers_enough_distinct_cases():
    assert len({c[0] for c in CASES}) == len(CASES) >= 20


# --------------------------------------------------------------------------------------------- the schema

def _leaf_types(hint):
    """The types a field's values have: X for X, Optional[X], List[X] and Dict[str, X]."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is typing.Union:
        return [t for a in args for t in _leaf_types(a)]
    if typing.get_origin(hint) is list:
        return args[:1]
    if typing.get_origin(hint) is dict:
        return args[1:2]
    return [hint]


def _schema_hints(schema=RecipeConfig, prefix=""):
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from _schema_hints(hints[f.name], f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", hints[f.name]


def _is(origin, hint) -> bool:
    """Whether ``hint`` is ``origin[...]`` or ``Optional[origin[...]]``."""
    return any(typing.get_origin(a) is origin for a in (hint, *typing.get_args(hint)))


NUMERIC = {key: hint for key, hint in _schema_hints() if {int, float} & set(_leaf_types(hint))}
# Lists of values; data.datasets is a list of sections (mappings), which no scalar stands for.
LISTS = {key: hint for key, hint in _schema_hints() if _is(list, hint) and _leaf_types(hint)[0] in (str, int, float)}


def test_every_numeric_setting_has_a_range_rule():
    metadata = dict(schema_fields())
    assert "trainer.max_steps" in NUMERIC and "callbacks.throughput.peak_tflops_table" in NUMERIC
    unchecked = [key for key in NUMERIC if not set(RANGE_RULES) & set(metadata[key].metadata)]
    assert not unchecked, f"numeric settings without a range rule ({', '.join(RANGE_RULES)}): {unchecked}"
    unknown = {key: sorted(set(f.metadata) - {"help", *RULES}) for key, f in metadata.items()}
    assert not any(unknown.values()), f"metadata keys no validator reads: {unknown}"


def _outside(meta):
    """A number that breaks ``meta``'s range rule."""
    if "allowed" in meta:
        return max(a for a in meta["allowed"] if a is not None) + 1
    if "max" in meta:
        return meta["max"] + 1
    if "min" in meta:
        return meta["min"] - 1
    return -1 if meta.get("non_negative") else 1 if meta.get("fraction") else 0


@pytest.mark.parametrize("key", sorted(NUMERIC))
def test_every_range_rule_is_enforced(key):
    meta, hint = dict(schema_fields())[key].metadata, NUMERIC[key]
    leaf = [t for t in _leaf_types(hint) if t in (int, float)][0]
    bad = str(leaf(_outside(meta)))
    if _is(list, hint):
        value = f"[{', '.join([bad] * meta.get('length', 1))}]"
    elif _is(dict, hint):
        value = f"{{x: {bad}}}"
    else:
        value = bad
    # The range's own message (not a type error, which would name the key too).
    with pytest.raises(ShardlightError, match=rf"^{re.escape(key)}\S* (must |'.*' is not allowed)"):
        load_recipe(None, [f"{key}={value}"])


@pytest.mark.parametrize("key", sorted(LISTS))
def test_a_scalar_for_any_list_key_is_a_one_item_list(key):
    leaf = _leaf_types(LISTS[key])[0]
    scalar = {str: "x", int: 2, float: 0.5}[leaf]
    section, _, name = key.rpartition(".")
    raw = {name: scalar}
    for part in reversed(section.split(".") if section else []):
        raw = {part: raw}
    _conform(raw, RecipeConfig, "", "test")
    for part in key.split("."):
        raw = raw[part]
    assert raw == [scalar]


def test_scalar_file_lists_resolve_like_lists(tmp_path):
    (tmp_path / "recipe.yaml").write_text(f"base: {DEFAULT_RECIPE}\ndata:\n  train_files: a.jsonl\n"
                                          "  val_files: [b.jsonl]\n")
    cfg = load_recipe(str(tmp_path / "recipe.yaml"), ["fsdp.transformer_cls_names_to_wrap=LlamaDecoderLayer",
                                                       "logging.wandb.tags=smoke"])
    assert cfg.data.train_files == [str(tmp_path / "a.jsonl")]
    assert cfg.data.val_files == [str(tmp_path / "b.jsonl")]
    assert cfg.fsdp.transformer_cls_names_to_wrap == ["LlamaDecoderLayer"]
    assert get_key(cfg, "logging.wandb.tags") == ["smoke"]
    # An override's relative path is the current directory's, as before.
    assert load_recipe(None, ["data.train_files=rel.jsonl"]).data.train_files == ["rel.jsonl"]


def test_an_empty_section_changes_nothing(tmp_path):
    # `trainer:` with all its keys commented out is YAML null: the section keeps its values.
    (tmp_path / "recipe.yaml").write_text(f"base: {DEFAULT_RECIPE}\ntrainer:\ncallbacks:\n  comm:\n")
    cfg = load_recipe(str(tmp_path / "recipe.yaml"), ["checkpoint=null"])
    default = load_recipe(None)
    assert (cfg.trainer, cfg.callbacks, cfg.checkpoint) == (default.trainer, default.callbacks, default.checkpoint)


def test_help_says_a_scalar_is_a_one_item_list(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "one-item list" in " ".join(capsys.readouterr().out.split())
