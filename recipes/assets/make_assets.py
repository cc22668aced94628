"""Generate the tiny synthetic SFT dataset and its byte-level BPE tokenizer (run once; outputs are committed).

    python recipes/assets/make_assets.py

Writes, deterministically (fixed seed, fixed word list):

* ``recipes/data/tiny_sft_train.jsonl`` and ``recipes/data/tiny_sft_val.jsonl``: rows ``{"prompt", "response"}``
  drawn from five small tasks a 2-layer, 64-wide Llama can visibly learn on CPU in a few dozen steps
  (reverse a word, uppercase a word, add two small numbers, repeat a word N times, next letter).
* ``recipes/assets/tiny-tokenizer/``: a ``PreTrainedTokenizerFast`` (byte-level BPE, 512 tokens, trained on the
  generated data wrapped in the default instruction template) with ``<|bos|>``, ``<|eos|>``, ``<|pad|>`` as
  bos/eos/pad. It prepends ``<|bos|>`` when called with ``add_special_tokens=True``, like Llama tokenizers.
"""

from __future__ import annotations

import json
import random
import string
from pathlib import Path

HERE = Path(__file__).resolve().parent
DATA_DIR = HERE.parent / "data"
TOKENIZER_DIR = HERE / "tiny-tokenizer"

SEED = 20240611
N_TRAIN = 4000
N_VAL = 200
VOCAB_SIZE = 512
SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>"]
# Same default as DataConfig.prompt_template, so the template's pieces become single tokens.
PROMPT_TEMPLATE = "### Instruction:\n{prompt}\n\n### Response:\n"

WORDS = (
    "cat dog sun map red cup hat pen box fox owl bee ant egg ice jam key leg net oak pig rat sky toy van web "
    "zip arm bag bed bus car day ear fan gum hen ink jet kid lip mud nut pot rug sea tea bird fish tree moon "
    "star rain snow wind lake road ship boat frog lion bear wolf duck milk cake rice corn leaf rock sand gold "
    "blue pink gray king ring song book door bell lamp desk coat sock shoe hand foot nose apple grape lemon "
    "melon plant river cloud storm stone tiger horse mouse sheep chair table clock bread honey"
).split()


def _reverse(rng: random.Random) -> tuple:
    word = rng.choice(WORDS)
    return f"Reverse the word: {word}", word[::-1]


def _upper(rng: random.Random) -> tuple:
    word = rng.choice(WORDS)
    return f"Uppercase the word: {word}", word.upper()


def _add(rng: random.Random) -> tuple:
    a, b = rng.randint(0, 20), rng.randint(0, 20)
    return f"Add: {a} + {b}", str(a + b)


def _repeat(rng: random.Random) -> tuple:
    word, n = rng.choice(WORDS), rng.randint(2, 4)
    return f"Repeat {word} {n} times", " ".join([word] * n)


def _next_letter(rng: random.Random) -> tuple:
    i = rng.randrange(25)
    return f"Next letter after {string.ascii_lowercase[i]}", string.ascii_lowercase[i + 1]


TASKS = (_reverse, _upper, _add, _repeat, _next_letter)


def make_rows(rng: random.Random, n: int) -> list:
    rows = []
    for _ in range(n):
        prompt, response = rng.choice(TASKS)(rng)
        rows.append({"prompt": prompt, "response": response})
    return rows


def write_jsonl(path: Path, rows: list) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def build_tokenizer(rows: list):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = [PROMPT_TEMPLATE.format(prompt=r["prompt"]) + r["response"] for r in rows]
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    bos = "<|bos|>"
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1", special_tokens=[(bos, tok.token_to_id(bos))]
        ),
    ])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )


def main() -> None:
    rng = random.Random(SEED)
    train, val = make_rows(rng, N_TRAIN), make_rows(rng, N_VAL)
    write_jsonl(DATA_DIR / "tiny_sft_train.jsonl", train)
    write_jsonl(DATA_DIR / "tiny_sft_val.jsonl", val)
    tokenizer = build_tokenizer(train)
    tokenizer.save_pretrained(str(TOKENIZER_DIR))
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    print(f"train rows: {len(train)}  val rows: {len(val)}")
    print(f"tokenizer: {TOKENIZER_DIR}  len={len(tokenizer)}  special ids={ids}")


if __name__ == "__main__":
    main()
