"""framework/data.py: tokenizer loading, preflight errors, tokenization, packing and label masking, loaders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shardlight.build import build_tokenizer
from shardlight.data import IGNORE_INDEX, SFTDataModule
from shardlight.data_files import check_data
from shardlight.errors import ShardlightError
from shardlight.recipe import RecipeConfig, load_recipe

REPO = Path(__file__).resolve().parents[1]
TOK_DIR = REPO / "recipes" / "assets" / "tiny-tokenizer"
TEMPLATE = "### Instruction:\n{prompt}\n\n### Response:\n"


def _cfg(**data) -> RecipeConfig:
    cfg = RecipeConfig()
    cfg.model.config = {"model_type": "llama"}
    cfg.tokenizer.name_or_path = str(TOK_DIR)
    cfg.trainer.micro_batch_size = 2
    for key, value in data.items():
        setattr(cfg.data, key, value)
    return cfg


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(_cfg())


def _jsonl(path: Path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _rows(n, start=0):
    return [{"prompt": f"Add: {i} + 1", "response": f"answer {i + 1}"} for i in range(start, start + n)]


def _setup(cfg, tok) -> SFTDataModule:
    dm = SFTDataModule(cfg, tok)
    dm.setup("fit")
    return dm


def _stream(ds):
    """Concatenate the real (attention_mask == 1) tokens and labels of every row, in order."""
    mask = ds.attention_mask.bool()
    return ds.input_ids[mask].tolist(), ds.labels[mask].tolist()


def _expected_instruction(tok, rows):
    ids, labels = [], []
    for r in rows:
        p = [tok.bos_token_id] + tok(TEMPLATE.format(prompt=r["prompt"]), add_special_tokens=False)["input_ids"]
        a = tok(r["response"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        ids += p + a
        labels += [IGNORE_INDEX] * len(p) + a
    return ids, labels


def _supervised_text(tok, ds) -> str:
    labels = ds.labels[ds.labels != IGNORE_INDEX]
    return tok.decode(labels.tolist())


# --------------------------------------------------------------------------------------------- tokenizer

def test_shipped_tokenizer(tok):
    assert len(tok) == 512
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|bos|>", "<|eos|>", "<|pad|>")
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2)


def test_build_tokenizer_errors(tmp_path):
    cfg = _cfg()
    cfg.tokenizer.name_or_path = str(tmp_path / "no-such-tokenizer")
    with pytest.raises(ShardlightError, match=r"^tokenizer not found: .*no-such-tokenizer.*tokenizer.name_or_path"):
        build_tokenizer(cfg)
    cfg.tokenizer.name_or_path = None
    with pytest.raises(ShardlightError, match="tokenizer not found") as exc:
        build_tokenizer(cfg)
    assert "\n" not in str(exc.value)


def count_label_tokens(batch):
    """Tokens that contribute to the causal-LM loss: ``labels[..., 1:] != -100`` (HF models shift labels)."""
    return int((batch["labels"][..., 1:] != IGNORE_INDEX).sum())


# --------------------------------------------------------------------------------------------- packing

def _examples(ds):
    """The examples in a block dataset, in order: (ids, labels) of each run of real tokens whose positions count
    up from 0 (packed), or of each row's real tokens (unpacked)."""
    out = []
    for i in range(len(ds)):
        row = ds[i]
        real = row["attention_mask"].bool()
        ids, labels = row["input_ids"][real].tolist(), row["labels"][real].tolist()
        if "position_ids" not in row:
            out.append((ids, labels))
            continue
        starts = [j for j, p in enumerate(row["position_ids"][real].tolist()) if p == 0] + [len(ids)]
        out += [(ids[s:e], labels[s:e]) for s, e in zip(starts, starts[1:])]
    return out


def test_packing_places_whole_examples_with_restarting_positions(tmp_path, tok):
    rows = [{"prompt": "Add: " + "1 + " * (i % 7) + "1", "response": f"answer {i}"} for i in range(40)]
    train = _jsonl(tmp_path / "train.jsonl", rows)
    dm = _setup(_cfg(train_files=[train], val_files=[train], seq_len=64, packing=True), tok)
    exp_ids, exp_labels = _expected_instruction(tok, rows)
    lengths = [len(_expected_instruction(tok, [r])[0]) for r in rows]

    for ds in (dm.val_dataset, dm.train_dataset):  # training keeps every block too: none is cut
        assert ds.input_ids.shape[1] == 64 and _stream(ds) == (exp_ids, exp_labels)
        assert [len(ids) for ids, _ in _examples(ds)] == lengths  # whole examples, in order, none split
        assert len(ds) <= len(rows) / 2  # several examples per block
        for i in range(len(ds)):
            row = ds[i]
            real = row["attention_mask"].bool()
            n = int(real.sum())
            assert real[:n].all() and not real[n:].any()  # real tokens first, then padding
            assert (row["input_ids"][~real] == tok.pad_token_id).all()
            assert (row["labels"][~real] == IGNORE_INDEX).all() and (row["position_ids"][~real] == 0).all()
            starts = row["position_ids"] == 0
            assert (row["labels"][starts & real] == IGNORE_INDEX).all()  # no example's first token is scored
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"input_ids", "attention_mask", "labels", "position_ids"}
    assert all(v.dtype == torch.long and v.shape == (2, 64) for v in batch.values())


def _tiny_model(attn_implementation: str):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_a_packed_block_has_the_loss_and_gradients_of_its_examples_one_by_one(tmp_path, tok, attn_implementation):
    """Truth by construction: the packed block's summed loss and its gradients equal those of its examples run
    alone (no padding, no mask), so packing changes nothing of what the model learns."""
    from shardlight.lm_loss import loss_sum

    rows = [{"prompt": "Add: " + "2 + " * (i % 5) + "3", "response": "answer " * (1 + i % 3)} for i in range(12)]
    train = _jsonl(tmp_path / "train.jsonl", rows)
    block = _setup(_cfg(train_files=[train], val_files=[train], seq_len=96, packing=True), tok).val_dataset
    batch = {k: v[:2].long() for k, v in block.arrays.items()}
    model = _tiny_model(attn_implementation)
    packed, packed_count = loss_sum(model, batch)
    packed.backward()
    packed_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    examples = _examples(_Rows(batch))
    assert len(examples) > 2  # the two blocks hold several examples
    alone, alone_count = 0.0, 0
    for ids, labels in examples:
        one = {"input_ids": torch.tensor([ids]), "labels": torch.tensor([labels]),
               "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}
        total, count = loss_sum(model, one)
        alone, alone_count = alone + total, alone_count + count
    alone.backward()
    assert int(packed_count) == int(alone_count)
    assert torch.allclose(packed, alone, rtol=1e-5, atol=0)
    for got, want in zip(packed_grads, (p.grad for p in model.parameters())):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


class _Rows:
    """A batch dict seen as a dataset of its rows (what ``_examples`` reads)."""

    def __init__(self, batch):
        self.batch = batch

    def __len__(self):
        return len(self.batch["input_ids"])

    def __getitem__(self, i):
        return {k: v[i] for k, v in self.batch.items()}


def test_the_first_validation_loss_is_the_same_with_and_without_packing(tok):
    """The shipped recipe's validation data, one set of weights: the token-weighted loss over packed blocks
    equals the one over one row per example (on the old concatenating packing it was 6.2331 against 6.2811)."""
    from shardlight.lm_loss import loss_sum

    val = str(REPO / "recipes" / "data" / "tiny_sft_val.jsonl")
    model = _tiny_model("sdpa")

    def val_loss(packing: bool) -> float:
        dm = _setup(_cfg(train_files=[val], val_files=[val], seq_len=128, packing=packing), tok)
        total, count = torch.zeros((), dtype=torch.float64), 0
        with torch.no_grad():
            for batch in dm.val_dataloader():
                s, c = loss_sum(model, batch)
                total, count = total + s.double(), count + int(c)
        return float(total / count)

    packed, unpacked = val_loss(True), val_loss(False)
    assert packed == pytest.approx(unpacked, rel=1e-6)


def test_val_fraction_holdout_is_deterministic(tmp_path, tok):
    train = _jsonl(tmp_path / "train.jsonl", _rows(100))
    cfg = _cfg(train_files=[train], val_fraction=0.1, seq_len=32, packing=False)

    def split(seed):
        cfg.trainer.seed = seed
        dm = _setup(cfg, tok)
        return _supervised_text(tok, dm.train_dataset), _supervised_text(tok, dm.val_dataset), dm.stats

    tr, va, stats = split(1)
    assert (stats["train_examples"], stats["val_examples"]) == (90, 10)
    answers = {f"answer {i + 1}<|eos|>" for i in range(100)}
    val_answers = {a for a in answers if a in va}
    assert len(val_answers) == 10 and not any(a in tr for a in val_answers)
    assert split(1)[:2] == (tr, va)
    assert split(2)[1] != va


# --------------------------------------------------------------------------------------------- no packing

def test_no_packing_pads_and_truncates(tmp_path, tok):
    rows = _rows(6)
    train = _jsonl(tmp_path / "train.jsonl", rows)
    dm = _setup(_cfg(train_files=[train], val_files=[train], seq_len=48, packing=False), tok)
    exp_ids, exp_labels = _expected_instruction(tok, rows)
    ds = dm.val_dataset
    assert ds.input_ids.shape == (6, 48)
    assert _stream(ds) == (exp_ids, exp_labels)
    for i in range(len(ds)):
        row = ds[i]
        real = row["attention_mask"].bool()
        assert real[0] and (~real).any()  # left-aligned, right-padded
        assert (row["input_ids"][~real] == tok.pad_token_id).all()
        assert (row["labels"][~real] == IGNORE_INDEX).all()

    # Truncated so short that no answer token is left: those rows carry no loss and are dropped.
    n_prompt = 1 + len(tok(TEMPLATE.format(prompt=rows[0]["prompt"]), add_special_tokens=False)["input_ids"])
    with pytest.raises(ShardlightError, match="training data gives 0 sequences of"):
        _setup(_cfg(train_files=[train], val_files=[train], seq_len=n_prompt, packing=False), tok)
    dm = _setup(_cfg(train_files=[train], val_files=[train], seq_len=n_prompt + 2, packing=False), tok)
    assert len(dm.val_dataset) == 6 and count_label_tokens({"labels": dm.val_dataset.labels}) == 12


# --------------------------------------------------------------------------------------------- chat / text

CHAT = [{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                      {"role": "assistant", "content": "hello"}, {"role": "user", "content": "sum 2 2"},
                      {"role": "assistant", "content": "4"}]}]


def test_chat_builtin_template(tmp_path, tok):
    assert not tok.chat_template
    path = _jsonl(tmp_path / "chat.jsonl", CHAT * 3)
    dm = _setup(_cfg(train_files=[path], val_files=[path], format="chat", seq_len=128, packing=False), tok)
    row = dm.val_dataset[0]
    text = tok.decode(row["input_ids"][row["attention_mask"].bool()].tolist())
    assert text == ("<|bos|><|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\nhello<|eos|>"
                    "<|user|>\nsum 2 2\n<|assistant|>\n4<|eos|>")
    assert tok.decode(row["labels"][row["labels"] != IGNORE_INDEX].tolist()) == "hello<|eos|>4<|eos|>"


def test_chat_tokenizer_template(tmp_path):
    tok = build_tokenizer(_cfg())
    tok.chat_template = ("{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}{{ eos_token }}\n"
                         "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}")
    path = _jsonl(tmp_path / "chat.jsonl", CHAT * 4)
    dm = _setup(_cfg(train_files=[path], val_files=[path], format="chat", seq_len=64, packing=True), tok)
    ds = dm.val_dataset
    assert tok.decode(_stream(ds)[0]) == tok.apply_chat_template(CHAT[0]["messages"], tokenize=False) * 4
    assert _supervised_text(tok, ds) == "hello<|eos|>\n4<|eos|>\n" * 4


def test_text_format_trains_all_tokens(tmp_path, tok):
    (tmp_path / "corpus.txt").write_text("the cat sat\n\nthe dog ran\n")
    cfg = _cfg(train_files=[str(tmp_path / "corpus.txt")], val_files=[str(tmp_path / "corpus.txt")],
               format="text", seq_len=16, packing=False)
    check_data(cfg)
    ds = _setup(cfg, tok).val_dataset
    assert len(ds) == 2  # the blank line is no example
    assert tok.decode(_stream(ds)[0]) == "<|bos|>the cat sat<|eos|><|bos|>the dog ran<|eos|>"
    assert _supervised_text(tok, ds) == "the cat sat<|eos|>the dog ran<|eos|>"


# --------------------------------------------------------------------------------------------- check_data

@pytest.mark.parametrize("name, content, pattern", [
    ("missing.jsonl", None, r"^data file not found: .*missing\.jsonl$"),
    ("data.xlsx", "x", r"unsupported data file type '\.xlsx'; allowed: \.jsonl, \.json, \.csv, \.parquet, \.txt"),
    ("empty.jsonl", "", r"^data file is empty: "),
    ("blank.jsonl", "\n  \n", r"^data file is empty: "),
    ("field.jsonl", '{"prompt": "a", "response": "b"}\n{"prompt": "c"}\n',
     r"field\.jsonl:2: row is missing field 'response' \(format: instruction needs prompt, response\)$"),
    ("bad.jsonl", '{"prompt": "a", "response": "b"}\n\n{"prompt": "c", \n', r"bad\.jsonl:3: invalid JSON: "),
    ("null.jsonl", '{"prompt": "a", "response": null}\n', r"null\.jsonl:1: field 'response' must be a string, got null"),
    ("list.json", '[{"prompt": "a", "response": "b"}, {"response": "b"}]', r"list\.json: row 2: row is missing field 'prompt'"),
    ("cols.csv", "prompt,answer\na,b\n", r"cols\.csv: missing column 'response' .*columns: prompt, answer"),
    ("header.csv", "prompt,response\n", r"^data file is empty: "),
    ("plain.txt", "hello\n", r"need data\.format: text"),
])
def test_check_data_errors(tmp_path, name, content, pattern):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(ShardlightError, match=pattern) as exc:
        check_data(_cfg(train_files=[str(path)]))
    assert "\n" not in str(exc.value)


def test_check_data_chat_and_valid_files(tmp_path):
    bad = _jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user"}]}])
    with pytest.raises(ShardlightError, match=r"chat\.jsonl:1: message 0 in 'messages' needs a string 'content'"):
        check_data(_cfg(train_files=[bad], format="chat"))
    good = _jsonl(tmp_path / "good.jsonl", _rows(3))
    (tmp_path / "good.csv").write_text("prompt,response\na,b\n")
    check_data(_cfg(train_files=[good], val_files=[str(tmp_path / "good.csv")]))
    check_data(_cfg(train_files=[], dataset="some/hub-dataset"))  # hub datasets are not checked offline
    with pytest.raises(ShardlightError, match="mixes file types"):
        check_data(_cfg(train_files=[good, str(tmp_path / "good.csv")]))
    with pytest.raises(ShardlightError, match="prompt_template"):
        check_data(_cfg(train_files=[good], prompt_template="{prompt} {oops}"))


BOM = b"\xef\xbb\xbf"  # the UTF-8 byte-order mark Windows editors and Excel put at a file's start


@pytest.mark.parametrize("name", ["rows.jsonl", "rows.json", "rows.csv"])
def test_utf8_bom_is_accepted_and_loads_like_plain_utf8(tmp_path, tok, name):
    rows = _rows(5)
    if name.endswith(".jsonl"):
        text = "".join(json.dumps(r) + "\n" for r in rows)
    elif name.endswith(".json"):
        text = json.dumps(rows)
    else:
        text = "prompt,response\n" + "".join(f"{r['prompt']},{r['response']}\n" for r in rows)
    plain, marked = tmp_path / f"plain-{name}", tmp_path / f"bom-{name}"
    plain.write_bytes(text.encode())
    marked.write_bytes(BOM + text.encode())

    def loaded(path):
        cfg = _cfg(train_files=[str(path)], val_files=[str(path)], seq_len=32, packing=False)
        check_data(cfg)
        return _stream(_setup(cfg, tok).val_dataset)

    assert loaded(marked) == loaded(plain) == _expected_instruction(tok, rows)


def test_utf8_bom_in_a_text_file_is_not_part_of_the_first_row(tmp_path, tok):
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(BOM + b"the cat sat\nthe dog ran\n")
    cfg = _cfg(train_files=[str(corpus)], val_files=[str(corpus)], format="text", seq_len=16, packing=False)
    check_data(cfg)
    ds = _setup(cfg, tok).val_dataset
    assert tok.decode(_stream(ds)[0]) == "<|bos|>the cat sat<|eos|><|bos|>the dog ran<|eos|>"


def test_hub_dataset_offline_error(tok, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    dm = SFTDataModule(_cfg(train_files=[], dataset="nobody/no-such-dataset-xyz"), tok)
    with pytest.raises(ShardlightError, match="could not load hub dataset 'nobody/no-such-dataset-xyz'") as exc:
        dm.setup("fit")
    assert "\n" not in str(exc.value)


# --------------------------------------------------------------------------------------------- loaders

def test_shuffling_is_seeded(tmp_path, tok):
    train = _jsonl(tmp_path / "train.jsonl", _rows(64))

    def order(seed, epochs=1):
        cfg = _cfg(train_files=[train], val_fraction=0.0, seq_len=24, packing=False)
        cfg.trainer.seed = seed
        loader = _setup(cfg, tok).train_dataloader()
        return [b["input_ids"][:, :20].tolist() for _ in range(epochs) for b in loader]

    first = order(7, epochs=2)
    assert first == order(7, epochs=2)
    assert first != order(8, epochs=2)
    half = len(first) // 2
    assert first[:half] != first[half:]  # a new permutation each epoch
    assert all(len(b) == 2 for b in first)  # drop_last, micro_batch_size 2


def test_recipe_with_shipped_data(tmp_path, tok):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "model:\n  config: {model_type: llama, hidden_size: 64, num_hidden_layers: 2}\n"
        f"tokenizer:\n  name_or_path: {TOK_DIR}\n"
        "data:\n  train_files: [data/train.jsonl]\n  val_files: [data/val.jsonl]\n  seq_len: 64\n"
        "trainer:\n  micro_batch_size: 4\n")
    (tmp_path / "data").mkdir()
    for name in ("train", "val"):
        (tmp_path / "data" / f"{name}.jsonl").write_text(
            (REPO / "recipes" / "data" / f"tiny_sft_{name}.jsonl").read_text())
    cfg = load_recipe(str(recipe), ["trainer.micro_batch_size=4"])
    check_data(cfg)
    dm = SFTDataModule(cfg, build_tokenizer(cfg))
    dm.setup("fit")
    assert dm.stats["train_examples"] == 4000 and dm.stats["val_examples"] == 200
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape == (4, 64) and count_label_tokens(batch) > 0
    val = list(dm.val_dataloader())
    assert sum(int((b["labels"][:, 1:] != IGNORE_INDEX).sum()) for b in val) > 0

    cfg.trainer.micro_batch_size = 10_000
    with pytest.raises(ShardlightError, match="fewer than one batch"):
        SFTDataModule(cfg, dm.tokenizer).setup("fit")


def test_chat_template_not_prefix_stable(tmp_path):
    """No generation prompt, last turn rendered differently: the first turn is found by its content (+ eos), the
    last is what rendering it adds, starting at its content."""
    tok = build_tokenizer(_cfg())
    tok.chat_template = ("{% for m in messages %}{{ m.role }}: {{ m.content }}{{ eos_token }}"
                         "{% if loop.last and not add_generation_prompt %}!{% endif %}\n{% endfor %}")
    path = _jsonl(tmp_path / "chat.jsonl", CHAT * 4)
    ds = _setup(_cfg(train_files=[path], val_files=[path], format="chat", seq_len=64, packing=True), tok).val_dataset
    assert _supervised_text(tok, ds) == "hello<|eos|>4<|eos|>!" * 4


def test_packing_is_refused_for_a_model_that_cannot_keep_examples_apart():
    from shardlight.build import build_hf_config
    from shardlight.preflight import build_skeleton, check_packing

    def skeleton(config):
        cfg = _cfg()
        cfg.model.config, cfg.model.attn_implementation = config, "eager"
        return build_skeleton(cfg.model, build_hf_config(cfg.model))

    check_packing(skeleton({"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 1,
                            "num_attention_heads": 4, "intermediate_size": 64, "vocab_size": 512}))
    bloom = skeleton({"model_type": "bloom", "n_layer": 1, "hidden_size": 32, "n_head": 4, "vocab_size": 512})
    with pytest.raises(ShardlightError, match=r"^data\.packing: true needs .*; BloomForCausalLM has none; "
                                              r"set data\.packing: false$"):
        check_packing(bloom)  # ALiBi, no position_ids: nothing would keep the examples apart


# --------------------------------------------------------------------------------------------- chat templates

def test_the_saved_tokenizer_renders_each_example_exactly_as_it_was_trained(tmp_path):
    """Every way to choose a template (built-in, a string, a file named in a recipe, the tokenizer's own): the
    tokenizer saved as the export saves it renders each conversation to exactly the text training used."""
    from transformers import AutoTokenizer

    string = "{% for m in messages %}{{ m.role + ': ' + m.content + eos_token }}{% endfor %}"
    (tmp_path / "templates").mkdir()
    (tmp_path / "templates" / "chat.jinja").write_text("{% for m in messages %}[{{ m.role }}]{{ m.content }}"
                                                       "{% endfor %}{{ eos_token }}")
    path = _jsonl(tmp_path / "chat.jsonl", CHAT + [{"messages": CHAT[0]["messages"][1:3]}])
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model:\n  config: {{model_type: llama}}\ntokenizer:\n  name_or_path: {TOK_DIR}\n"
                      f"data:\n  train_files: [{path}]\n  format: chat\n  chat_template: templates/chat.jinja\n")
    from_file = load_recipe(str(recipe), [])
    assert from_file.data.chat_template == str(tmp_path / "templates" / "chat.jinja")
    own = tmp_path / "own-tokenizer"
    tokenizer = build_tokenizer(_cfg(format="chat"))
    tokenizer.chat_template = string
    tokenizer.save_pretrained(own)

    cases = {"built-in": _cfg(format="chat"), "string": _cfg(format="chat", chat_template=string),
             "file": from_file, "tokenizer": _cfg(format="chat", chat_template="tokenizer")}
    cases["tokenizer"].tokenizer.name_or_path = str(own)
    texts = set()
    for name, cfg in cases.items():
        cfg.data.train_files, cfg.data.val_files, cfg.data.packing = [path], [path], False
        cfg.trainer.micro_batch_size = 1
        tokenizer = build_tokenizer(cfg)
        ds = _setup(cfg, tokenizer).val_dataset
        tokenizer.save_pretrained(tmp_path / name)
        exported = AutoTokenizer.from_pretrained(tmp_path / name)
        for i, row in enumerate((CHAT[0], {"messages": CHAT[0]["messages"][1:3]})):
            trained = tokenizer.decode(ds[i]["input_ids"][ds[i]["attention_mask"].bool()].tolist())
            assert exported.apply_chat_template(row["messages"], tokenize=False) == trained, name
            texts.add(trained)
    assert len(texts) == 2 * 3  # three different templates (string and tokenizer are the same one)


@pytest.mark.parametrize("template, pattern", [
    ("tokenizer", r"^data\.chat_template: tokenizer, but tokenizer .* has no chat template; give a template"),
    ("/no/such/chat.jinja", r"^data\.chat_template: /no/such/chat\.jinja is not a file; allowed: a Jinja"),
    ("{% for m in messages %}{{ m.content }}", r"^data\.chat_template does not render a conversation: "),
])
def test_chat_template_errors(template, pattern):
    with pytest.raises(ShardlightError, match=pattern) as exc:
        build_tokenizer(_cfg(format="chat", chat_template=template))
    assert "\n" not in str(exc.value)
