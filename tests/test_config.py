"""Recipe loading, inheritance, overrides, validation, and the CLI's one-line errors for bad input."""

import json
import textwrap

import pytest
from conftest import DEFAULT_RECIPE, REPO, forbid_training

from shardlight.cli.main import main
from shardlight.errors import ShardlightError
from shardlight.recipe import load_recipe, to_yaml


def write(path, text):
    path.write_text(textwrap.dedent(text))
    return path


def test_default_recipe_loads_and_resolves_paths_relative_to_the_recipe():
    cfg = load_recipe(None)
    assert cfg.name == "tiny-llama-sft"
    assert cfg.data.train_files == [str(REPO / "recipes" / "data" / "tiny_sft_train.jsonl")]
    assert cfg.tokenizer.name_or_path == str(REPO / "recipes" / "assets" / "tiny-tokenizer")
    assert cfg.fsdp.sharding_strategy == "FULL_SHARD"
    assert cfg.fsdp.auto_wrap_policy == "TRANSFORMER_BASED_WRAP"
    assert cfg.model.trust_remote_code is False


def test_a_shipped_recipe_by_name_and_a_copy_of_it(tmp_path, monkeypatch, capsys):
    """By name from anywhere (the shipped file); a copy, which loads to the same recipe from its own folder and
    then wins over the shipped one; an unknown name lists the shipped ones; no overwrite without force."""
    from shardlight.recipe.catalog import catalog, copy_recipe

    monkeypatch.chdir(tmp_path)
    shipped = load_recipe("tiny-llama-lora")
    assert shipped.peft.method == "lora" and shipped.name == "tiny-llama-lora"
    assert load_recipe("recipes/tiny-llama-lora.yaml") == shipped
    copied = copy_recipe("tiny-llama-lora", "mine/")
    assert copied == tmp_path / "mine" / "tiny-llama-lora.yaml"
    assert load_recipe(str(copied)) == shipped
    (tmp_path / "tiny-llama-sft.yaml").write_text("base: recipes/tiny-llama-sft.yaml\ntrainer: {max_steps: 7}\n")
    assert load_recipe("tiny-llama-sft").trainer.max_steps == 7  # the user's file wins
    with pytest.raises(ShardlightError, match=r"no shipped recipe is named 'nope'; shipped recipes: llama-3-70b"):
        load_recipe("nope")
    with pytest.raises(ShardlightError, match="exists; pass --force to overwrite it"):
        copy_recipe("tiny-llama-lora", str(copied))
    assert [row["name"] for row in catalog()] == sorted(p.stem for p in (REPO / "recipes").glob("*.yaml"))
    assert main(["recipes"]) == 0
    assert "tiny-llama-lora     llama (inline config)    FSDP1 FULL_SHARD + LoRA" in capsys.readouterr().out


def test_inheritance_and_overrides(tmp_path):
    child = write(tmp_path / "child.yaml", f"""
        base: {DEFAULT_RECIPE}
        trainer:
          max_steps: 7
        fsdp:
          transformer_layer_cls_to_wrap: [LlamaDecoderLayer]
    """)
    cfg = load_recipe(str(child), ["optim.lr=0.01", "fsdp.sharding_strategy=shard_grad_op", "data.seq_len=64"])
    assert cfg.name == "child"
    assert cfg.trainer.max_steps == 7          # from the child
    assert cfg.trainer.devices == 2            # from the base
    assert cfg.optim.lr == 0.01                # from the command line
    assert cfg.data.seq_len == 64
    assert cfg.fsdp.sharding_strategy == "SHARD_GRAD_OP"   # case-insensitive like Accelerate
    assert cfg.fsdp.transformer_cls_names_to_wrap == ["LlamaDecoderLayer"]  # Accelerate's alias
    # the base's relative paths stay relative to the base file
    assert cfg.data.train_files[0].startswith(str(REPO / "recipes"))
    # the resolved YAML round-trips to the same recipe
    again = write(tmp_path / "again.yaml", to_yaml(cfg))
    assert to_yaml(load_recipe(str(again))).replace("name: again", "name: child") == to_yaml(cfg)


def test_inheritance_loop_is_an_error(tmp_path):
    write(tmp_path / "a.yaml", "base: b.yaml\n")
    write(tmp_path / "b.yaml", "base: a.yaml\n")
    with pytest.raises(ShardlightError, match="inheritance loop"):
        load_recipe(str(tmp_path / "a.yaml"))


def test_print_config(capsys):
    assert main(["train", "--print-config", "trainer.max_steps=3"]) == 0
    out = capsys.readouterr().out
    assert "max_steps: 3" in out and "sharding_strategy: FULL_SHARD" in out


# Each case: (recipe text or None for the default, overrides, expected message fragment).
BAD = [
    ("missing_recipe", "MISSING", [], "recipe file not found"),
    ("yaml_syntax", "trainer:\n  max_steps: 3\n bad: [\n", [], "YAML syntax error in {path}:3"),
    ("unknown_key", None, ["trainer.max_stepz=3"], "did you mean 'trainer.max_steps'"),
    ("unknown_section", "trainr:\n  max_steps: 3\n", [], "unknown recipe key 'trainr'"),
    ("wrong_type", None, ["trainer.max_steps=abc"], "'trainer.max_steps'"),
    ("bad_format", None, ["data.format=prose"], "allowed values: text, instruction, chat"),
    ("bad_schedule", None, ["optim.schedule=step"], "allowed values: cosine, linear, constant"),
    ("bad_sharding", None, ["fsdp.sharding_strategy=ZERO3"], "allowed values: null, FULL_SHARD, SHARD_GRAD_OP"),
    ("bad_precision", None, ["trainer.precision=fp8"], "trainer.precision: 'fp8' is not allowed"),
    ("negative_lr", None, ["optim.lr=-0.001"], "optim.lr must be positive"),
    ("zero_steps", None, ["trainer.max_steps=0"], "trainer.max_steps must be positive"),
    ("not_an_override", None, ["trainer.max_steps"], "not an override of the form key.path=value"),
    ("seq_len_too_long", None, ["data.seq_len=4096"], "exceeds the model's maximum positions (512)"),
    ("data_file_missing", None, ["data.train_files=[/nonexistent/train.jsonl]"], "/nonexistent/train.jsonl"),
    ("tokenizer_missing", None, ["tokenizer.name_or_path=/nonexistent/tok"], "tokenizer not found"),
    ("wrap_class_missing", None, ["fsdp.transformer_cls_names_to_wrap=[GPT2Block]"],
     "GPT2Block not found in the model; module classes present:"),
    ("both_model_sources", None, ["model.name_or_path=/some/model"], "set exactly one of model.name_or_path"),
    ("base_missing", "base: nowhere.yaml\n", [], "base recipe 'nowhere.yaml'"),
    ("bad_betas", None, ["optim.betas=[0.9]"], "optim.betas must have 2 items, got [0.9]"),
]


@pytest.mark.parametrize("name,recipe,overrides,expected", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_one_clear_line(tmp_path, capsys, monkeypatch, name, recipe, overrides, expected):
    forbid_training(monkeypatch)
    out_dir = tmp_path / "out"
    if recipe == "MISSING":
        path = str(tmp_path / "missing.yaml")
    elif recipe is None:
        path = str(DEFAULT_RECIPE)
    else:
        path = str(write(tmp_path / f"{name}.yaml", recipe))
    code = main(["train", path, f"output_dir={out_dir}", *overrides])
    err = capsys.readouterr().err
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert expected.format(path=path) in lines[0]
    assert "Traceback" not in err
    assert not out_dir.exists(), "nothing may be written before the input is valid"


def test_bad_data_rows_name_file_and_line(tmp_path, capsys, monkeypatch):
    forbid_training(monkeypatch)
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"prompt": "a", "response": "b"}) + "\n" + json.dumps({"prompt": "c"}) + "\n")
    code = main(["train", f"output_dir={tmp_path / 'out'}", f"data.train_files=[{data}]"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: ") and f"{data}:2" in err and "response" in err
    data.write_text(json.dumps({"prompt": "a", "response": "b"}) + "\n{not json\n")
    code = main(["train", f"output_dir={tmp_path / 'out'}", f"data.train_files=[{data}]"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and f"{data}:2" in err and "JSON" in err
    assert not (tmp_path / "out").exists()


def test_cli_exit_code_and_help(cli):
    result = cli(["train", "/nonexistent.yaml"])
    assert result.returncode == 2
    assert result.stderr.strip() == "error: recipe file not found: /nonexistent.yaml"
    help_text = cli(["--help"]).stdout
    assert "train" in help_text and "analyze" in help_text
    assert "--summary-json" in cli(["train", "--help"]).stdout
