"""Preflight through the real CLI, in-process: every bad input is exit code 2 and one ``error:`` line on
stderr, before a rank is spawned and before anything is written under output_dir."""

import importlib.util
import time
import warnings

import huggingface_hub.constants
import pytest
from conftest import forbid_training

import shardlight.build.training_model
from shardlight.cli.main import main
from shardlight.launch.launchers import RUN_ENV_VARS
from shardlight.preflight import usable_cores

GPT2 = ["model.config.model_type=gpt2", "fsdp.transformer_cls_names_to_wrap=[GPT2Block]"]
# Port 9 (discard) on the loopback: refused at once on any machine, with or without network.
UNREACHABLE_ENDPOINT = "http://127.0.0.1:9"


@pytest.fixture(autouse=True)
def in_process_run(monkeypatch):
    """A case that gets past preflight exports the run's variables (``ctx.export()``); keep them out of
    the next test's process environment."""
    forbid_training(monkeypatch)
    for name in RUN_ENV_VARS:
        monkeypatch.setenv(name, "")  # recorded as absent, so it is removed again afterwards
        monkeypatch.delenv(name)


@pytest.fixture
def hub_unreachable(monkeypatch):
    """The network path, as on an air-gapped node: offline mode off, the hub at an address nobody answers."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", UNREACHABLE_ENDPOINT)
    shardlight.build.training_model.hub_reachable.cache_clear()
    yield
    shardlight.build.training_model.hub_reachable.cache_clear()


def assert_one_line_error(capfd, code, *expected):
    """Exit 2 and a stderr that is exactly one ``error:`` line containing every ``expected`` fragment."""
    err = capfd.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for fragment in expected:
        assert fragment in lines[0], lines[0]
    return lines[0]


def assert_nothing_written(out_dir):
    assert not out_dir.exists() or not any(out_dir.rglob("*")), sorted(out_dir.rglob("*"))


BAD_MODELS = [
    # refused when transformers builds the config
    ("hidden_not_divisible", ["model.config.hidden_size=130"],
     "model.config: The hidden size (130) is not a multiple of the number of attention heads (4)"),
    ("hidden_not_an_int", ["model.config.hidden_size=abc"], "model.config: Field 'hidden_size' expected int"),
    ("zero_heads", ["model.config.num_attention_heads=0"], "model.config: "),
    # refused only when transformers builds the model
    ("negative_hidden", ["model.config.hidden_size=-4"], "model.config: Trying to create tensor with negative dimension -4"),
    ("negative_intermediate", ["model.config.intermediate_size=-1"], "negative dimension -1"),
    ("unknown_activation", ["model.config.hidden_act=nope"], "model.config: unknown name 'nope'"),
    ("attention_unsupported_by_architecture", [*GPT2, "model.attn_implementation=flex_attention"],
     "model.attn_implementation: flex_attention does not work", "use one of: eager, sdpa"),
    # refused by the one training step on fake tensors (transformers 5 checks no grouped-query split)
    ("kv_heads_not_dividing_heads", ["model.config.num_key_value_heads=3"],
     "model.config: the model's training step fails before any rank starts",
     "size of tensor a (4) must match the size of tensor b (3)"),
    ("tp_plan_that_breaks_attention", ["fsdp.fsdp_version=2", "parallelism.tp_size=2", "trainer.devices=4",
                                       "parallelism.tp_plan={model.layers.*.self_attn.q_proj: colwise}"],
     "parallelism.tp_size 2: the tensor-parallel model's training step fails"),
    ("tied_weight_across_units", ["model.config.tie_word_embeddings=true",
                                  "fsdp.transformer_cls_names_to_wrap=[LlamaDecoderLayer,Embedding]"],
     "are one tied weight in two FSDP units", "set fsdp.transformer_cls_names_to_wrap: [LlamaDecoderLayer]"),
    ("tied_head_in_the_tp_plan", ["model.config.tie_word_embeddings=true", "fsdp.fsdp_version=2",
                                  "parallelism.tp_size=2", "trainer.devices=4",
                                  "parallelism.tp_plan={lm_head: colwise, model.layers.*.mlp.up_proj: colwise}"],
     "parallelism.tp_plan: lm_head would shard lm_head.weight, one weight with model.embed_tokens.weight",
     "leave lm_head out of the plan"),
    ("lora_on_a_tied_head", ["model.config.tie_word_embeddings=true", "peft.method=lora",
                             "peft.target_modules=[q_proj,lm_head]"],
     "peft: lm_head holds a weight tied to model.embed_tokens.weight", "leave lm_head out of peft.target_modules"),
    ("trainable_copy_of_a_tied_embedding", ["model.config.tie_word_embeddings=true", "peft.method=lora",
                                            "peft.target_modules=[q_proj]", "peft.modules_to_save=[embed_tokens]"],
     "peft: model.embed_tokens holds a weight tied to lm_head.weight"),
]
BAD_MODELS = [(case[0], case[1], case[2:]) for case in BAD_MODELS]


@pytest.mark.parametrize("name,overrides,expected", BAD_MODELS, ids=[c[0] for c in BAD_MODELS])
def test_bad_model_is_one_line_before_spawn(tmp_path, capfd, name, overrides, expected):
    out = tmp_path / "runs"
    code = main(["train", f"output_dir={out}", *overrides])
    assert_one_line_error(capfd, code, *expected)
    assert_nothing_written(out)


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash-attn is installed here")
def test_attention_missing_from_this_environment_names_the_working_ones(tmp_path, capfd):
    out = tmp_path / "runs"
    code = main(["train", f"output_dir={out}", "model.attn_implementation=flash_attention_2"])
    assert_one_line_error(capfd, code, "model.attn_implementation: flash_attention_2", "be installed",
                          "use one of: eager, sdpa, flex_attention")
    assert_nothing_written(out)


def test_launch_slurm_dry_run_with_a_bad_model(tmp_path, capfd):
    out = tmp_path / "runs"
    code = main(["launch", "slurm", "--nodes", "1", "--gpus-per-node", "1", "--dry-run",
                 f"output_dir={out}", "model.config.hidden_size=130"])
    assert_one_line_error(capfd, code, "model.config: The hidden size (130)")
    assert_nothing_written(out)
    assert capfd.readouterr().out == ""  # no script printed


def test_output_dir_under_a_file(tmp_path, capfd):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    code = main(["train", f"output_dir={blocker / 'runs'}"])
    assert_one_line_error(capfd, code, f"output_dir '{blocker / 'runs'}' cannot be created: Not a directory")
    assert blocker.read_text() == "x"


def test_output_dir_that_is_a_file(tmp_path, capfd):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    code = main(["train", f"output_dir={blocker}"])
    assert_one_line_error(capfd, code, f"output_dir '{blocker}' is a file")


def test_output_dir_that_cannot_hold_files(capfd):
    # /proc is a directory where nobody, root included, may create a file (a chmod'ed dir does not stop root).
    code = main(["train", "output_dir=/proc"])
    assert_one_line_error(capfd, code, "output_dir '/proc' is not writable")
    code = main(["train", "output_dir=/proc/shardlight-runs"])
    assert_one_line_error(capfd, code, "output_dir '/proc/shardlight-runs' cannot be created")


def test_far_more_cpu_ranks_than_cores_is_refused(tmp_path, capfd):
    out, ranks = tmp_path / "runs", 2 * usable_cores() + 1
    code = main(["train", f"output_dir={out}", f"trainer.devices={ranks}"])
    assert_one_line_error(capfd, code, f"trainer.devices={ranks}", f"{usable_cores()} usable cores",
                          "trainer.allow_oversubscribe=true")
    assert_nothing_written(out)


@pytest.mark.parametrize("overrides", [
    [f"trainer.devices={2 * usable_cores() + 1}", "trainer.allow_oversubscribe=true"],  # refused without the flag
    [f"trainer.devices={usable_cores() + 1}"],  # within twice the cores: a warning only
], ids=["allowed_by_flag", "warned"])
def test_oversubscription_gets_past_preflight(tmp_path, overrides):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(AssertionError, match="reached the Trainer"):
            main(["train", f"output_dir={tmp_path / 'runs'}", "trainer.progress_bar=false", *overrides])
    assert [str(w.message) for w in caught if "usable cores" in str(w.message)] == [
        f"shardlight: {overrides[0]} CPU ranks share {usable_cores()} usable cores; each step will be slower"]


def test_unreachable_hub_model_fails_fast(tmp_path, capfd, hub_unreachable):
    out, started = tmp_path / "runs", time.monotonic()
    code = main(["train", f"output_dir={out}", "model.config=null",
                 "model.name_or_path=shardlight-tests/no-such-model"])
    elapsed = time.monotonic() - started
    assert_one_line_error(capfd, code, "model.name_or_path 'shardlight-tests/no-such-model'", "cannot be reached",
                          "hf download shardlight-tests/no-such-model", "HF_HUB_OFFLINE=1")
    assert elapsed < 10, f"{elapsed:.1f} s: sat in Hugging Face's retries"
    assert_nothing_written(out)


def test_unreachable_hub_tokenizer_fails_fast(tmp_path, capfd, hub_unreachable):
    out, started = tmp_path / "runs", time.monotonic()
    code = main(["train", f"output_dir={out}", "tokenizer.name_or_path=shardlight-tests/no-such-tokenizer"])
    elapsed = time.monotonic() - started
    assert_one_line_error(capfd, code, "tokenizer.name_or_path 'shardlight-tests/no-such-tokenizer'",
                          "cannot be reached", "hf download shardlight-tests/no-such-tokenizer")
    assert elapsed < 10, f"{elapsed:.1f} s: sat in Hugging Face's retries"
    assert_nothing_written(out)


def test_offline_mode_never_touches_the_network(tmp_path, capfd, monkeypatch):
    def no_network():
        raise AssertionError("HF_HUB_OFFLINE is set, yet shardlight tried the network")

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(shardlight.build.training_model, "get_session", no_network)
    shardlight.build.training_model.hub_reachable.cache_clear()
    out = tmp_path / "runs"
    code = main(["train", f"output_dir={out}", "tokenizer.name_or_path=shardlight-tests/no-such-tokenizer"])
    assert_one_line_error(capfd, code, "tokenizer.name_or_path 'shardlight-tests/no-such-tokenizer'",
                          "HF_HUB_OFFLINE is set", "hf download shardlight-tests/no-such-tokenizer")
    assert_nothing_written(out)


@pytest.mark.parametrize("overrides,per_rank", [
    # the tiny Llama: 53,408 fp32 parameters (213,632 bytes); the root unit (embeddings + head, 131,200 bytes)
    # is FSDP1's largest; FSDP2 reads slices, the largest tensor being an embedding (65,536 bytes)
    (["fsdp.fsdp_version=1"], 213_632 // 2 + 131_200),
    (["fsdp.fsdp_version=2"], 213_632 // 2 + 65_536),
    (["fsdp.cpu_ram_efficient_loading=false"], 213_632),
], ids=["fsdp1", "fsdp2", "whole"])
def test_host_ram_for_the_load_is_printed_and_a_node_too_small_is_refused(tmp_path, capfd, monkeypatch, overrides,
                                                                          per_rank):
    from collections import namedtuple

    from conftest import save_tiny_llama

    ckpt = save_tiny_llama(tmp_path / "ckpt")
    args = ["train", f"output_dir={tmp_path / 'runs'}", f"model.name_or_path={ckpt}", "model.config=null",
            "trainer.devices=2", "trainer.progress_bar=false", *overrides]
    with pytest.raises(AssertionError, match="reached the Trainer"):
        main(args)
    err = capfd.readouterr().err
    assert f"about {2 * per_rank / 1e6:.1f} MB of host RAM per node (2 rank(s) x {per_rank / 1e6:.1f} MB" in err, err
    memory = namedtuple("Memory", "total available")
    monkeypatch.setattr("psutil.virtual_memory", lambda: memory(2 * per_rank - 1, 2 * per_rank - 1))
    out = tmp_path / "small"
    code = main([*args[:1], f"output_dir={out}", *args[2:]])
    assert_one_line_error(capfd, code, "it cannot hold the load")
    assert_nothing_written(out)
