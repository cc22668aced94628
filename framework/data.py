"""The SFT ``LightningDataModule``: rows → token blocks (files and checks: ``shardlight.data_files``; the tokenizer
and its chat template: ``shardlight.build.datamodule``).

Every example becomes ``input_ids`` plus ``labels`` (the ids of supervised tokens, -100 elsewhere; Hugging Face
causal-LM models shift labels internally). Formats:

* ``instruction``: ``bos? + prompt_template.format(prompt)`` (not supervised) ``+ response + eos`` (supervised).
* ``chat``: the conversation rendered with the tokenizer's chat template (``data.chat_template``); only the
  assistant turns (and their end-of-turn marker) are supervised.
* ``text``: ``bos? + text + eos``, all supervised (bos never is: nothing should learn to emit it).

An example longer than ``seq_len`` is truncated to it. With ``data.packing`` whole examples are placed one after
another into ``seq_len`` blocks (a new block when the next example does not fit; the rest padded), with
``position_ids`` that restart at each example: transformers then keeps attention inside each example, and no
example's first token is scored against the one before it, so a packed block's loss is exactly the sum of its
examples' losses. Without packing each example is one right-padded row. Examples in which no token would be
scored are dropped: they carry no loss. The training loader (``ResumableDataLoader``) resumes mid-epoch.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any, Dict, List, Optional, Tuple

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from shardlight.data_files import check_columns, expand_files, load_hub, load_local
from shardlight.errors import ShardlightError
from shardlight.prepared_data import Splits, cache_root, entry_key, file_digest, load_or_build
from shardlight.recipe import RecipeConfig, SourceConfig

log = logging.getLogger(__name__)

IGNORE_INDEX = -100


# ---------------------------------------------------------------- the loader that resumes mid-epoch
# Lightning restores its position from a checkpoint (the checkpoint callback writes it).
SKIP_BATCHES = "skip_batches"


class _SkipOnce:
    """Index sampler view that drops the loader's pending ``skip`` batches on the next pass only."""

    def __init__(self, base: Any, loader: "ResumableDataLoader") -> None:
        self.base, self.loader = base, loader

    def __iter__(self):
        # Consumed when iterated, not when looked at: len() on the loader must not use up the skip.
        skip, self.loader._pending_skip = self.loader._pending_skip, 0
        return itertools.islice(iter(self.base), skip, None)

    def __len__(self) -> int:
        # The full length: Lightning adds the restored batch count to what the iterator yields.
        return len(self.base)


class ResumableDataLoader(DataLoader):
    """A DataLoader Lightning treats as stateful, so a resumed run continues mid-epoch where it stopped.

    The state (batches already consumed this epoch) is written by the checkpoint callback from the loop's
    own counters, not counted here: Lightning may prefetch, so an iterator count would be off by one.
    """

    _pending_skip = 0

    def state_dict(self) -> Dict[str, Any]:
        return {SKIP_BATCHES: 0}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self._pending_skip = int(state.get(SKIP_BATCHES, 0))

    @property
    def _index_sampler(self):
        base = super()._index_sampler
        return _SkipOnce(base, self) if self._pending_skip else base


# ---- tokenization
Segments = List[Tuple[List[int], bool]]  # (token ids, supervised)


# The chat template of a tokenizer that has none (format: chat, data.chat_template null). It is written into
# the tokenizer, so the exported model renders conversations exactly as it was trained on them.
BUILTIN_CHAT_TEMPLATE = (  # newlines as expressions: transformers renders with trim_blocks
    "{% if bos_token %}{{ bos_token }}{% endif %}"
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\\n' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% else %}{{ '\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


class _Encoder:
    def __init__(self, tokenizer, d: SourceConfig):
        self.tok, self.d = tokenizer, d
        self.bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        self.eos = [tokenizer.eos_token_id]
        self.template = getattr(tokenizer, "chat_template", None) or BUILTIN_CHAT_TEMPLATE

    def ids(self, text: str) -> List[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"] if text else []

    def __call__(self, batch: Dict[str, list]) -> Dict[str, list]:
        d, out_ids, out_labels = self.d, [], []
        if d.format == "instruction":
            prompts = self.tok([d.prompt_template.format(prompt=p) for p in batch[d.prompt_field]],
                               add_special_tokens=False)["input_ids"]
            answers = self.tok(list(batch[d.response_field]), add_special_tokens=False)["input_ids"]
            examples = [[(self.bos + p, False), (a + self.eos, True)] for p, a in zip(prompts, answers)]
        elif d.format == "text":
            texts = [t if t and t.strip() else "" for t in batch[d.text_field]]
            encoded = self.tok(texts, add_special_tokens=False)["input_ids"]
            examples = [[(self.bos, False), (ids + self.eos, True)] if t else [] for t, ids in zip(texts, encoded)]
        else:
            examples = [self.chat(m) for m in batch[d.messages_field]]
        for segs in examples:
            out_ids.append([t for seg, _ in segs for t in seg])
            out_labels.append([t if sup else IGNORE_INDEX for seg, sup in segs for t in seg])
        return {"input_ids": out_ids, "labels": out_labels}

    def _render(self, messages, generation_prompt: bool = False) -> Optional[str]:
        try:
            return self.tok.apply_chat_template(messages, chat_template=self.template, tokenize=False,
                                                add_generation_prompt=generation_prompt)
        except Exception:
            return None

    def chat(self, messages: List[Dict[str, str]]) -> Segments:
        """Supervised character spans of the rendered chat: an assistant turn is what rendering it adds after
        the generation prompt (end-of-turn marker included); templates that are not prefix-stable fall back to
        locating the turn's content (plus a following eos) in the full text."""
        full = self._render(messages)
        if full is None:
            raise ShardlightError("the tokenizer's chat template failed to render a conversation; check "
                                  "data.messages_field rows (role/content) or the template")
        spans, cursor = [], 0
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            start_text = self._render(messages[:i], True) if i else None
            end_text = self._render(messages[: i + 1])
            if (start_text is not None and end_text is not None and full.startswith(end_text)
                    and end_text.startswith(start_text) and len(start_text) >= cursor):
                content_at = full.find(m["content"], len(start_text), len(end_text))
                span = (max(len(start_text), content_at), len(end_text))  # skip a header with no gen. prompt
            else:
                pos = full.find(m["content"], cursor)
                if pos < 0:
                    continue
                end = pos + len(m["content"])
                if self.tok.eos_token and full.startswith(self.tok.eos_token, end):
                    end += len(self.tok.eos_token)
                span = (pos, end)
            spans.append(span)
            cursor = span[1]
        segs: Segments = []
        prev = 0
        for start, end in spans:
            segs += [(self.ids(full[prev:start]), False), (self.ids(full[start:end]), True)]
            prev = end
        segs.append((self.ids(full[prev:]), False))
        return segs


# ---- blocks
class BlockDataset(Dataset):
    """Fixed-length rows; items are dicts of LongTensors ``[seq_len]``: ``input_ids``, ``labels``,
    ``attention_mask`` (1 on real tokens) and, for packed blocks, ``position_ids``."""

    def __init__(self, arrays: Dict[str, np.ndarray]):
        self.arrays = {name: torch.from_numpy(np.ascontiguousarray(a)) for name, a in arrays.items()}
        self.input_ids, self.labels = self.arrays["input_ids"], self.arrays["labels"]
        self.attention_mask = self.arrays["attention_mask"]

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        return {name: a[i].long() for name, a in self.arrays.items()}


def _flatten(ds) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Tokenized dataset → (all ids, all labels, per-example lengths) as flat numpy arrays."""
    import pyarrow.compute as pc

    if len(ds) == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    table = ds.with_format("arrow")[:]
    ids = table.column("input_ids").combine_chunks()
    labels = table.column("labels").combine_chunks()
    lengths = pc.fill_null(pc.list_value_length(ids), 0).to_numpy(zero_copy_only=False)
    return (ids.flatten().to_numpy(zero_copy_only=False).astype(np.int64),
            labels.flatten().to_numpy(zero_copy_only=False).astype(np.int64), lengths.astype(np.int64))


def _pack(lengths: np.ndarray, seq_len: int) -> Tuple[np.ndarray, np.ndarray]:
    """Each example's (block, offset in it), in order: a new block when the next example does not fit."""
    block, offset = np.empty(len(lengths), np.int64), np.empty(len(lengths), np.int64)
    current, used = 0, 0
    for j, n in enumerate(lengths.tolist()):
        if used + n > seq_len:
            current, used = current + 1, 0
        block[j], offset[j] = current, used
        used += n
    return block, offset


def make_blocks(ds, seq_len: int, pad_id: int, packing: bool) -> Dict[str, np.ndarray]:
    """Tokenized examples → ``[N, seq_len]`` rows: packed blocks of whole examples, or one per example."""
    flat_ids, flat_labels, lengths = _flatten(ds)
    starts = np.cumsum(lengths) - lengths
    if (lengths > seq_len).any():
        log.info("truncated %d of %d examples to data.seq_len=%d", (lengths > seq_len).sum(), len(lengths), seq_len)
    lengths = np.minimum(lengths, seq_len)
    # Every kept token: its example and its position in it.
    example = np.repeat(np.arange(len(lengths)), lengths)
    position = np.arange(len(example)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    source = starts[example] + position
    labels = flat_labels[source]
    labels[position == 0] = IGNORE_INDEX  # an example's first token is predicted by nothing of its own
    scored = np.bincount(example, weights=labels != IGNORE_INDEX, minlength=len(lengths)) > 0
    if not scored.all():
        log.info("dropped %d of %d examples with no supervised token", (~scored).sum(), len(scored))
    kept = scored[example]
    example, position, labels, source = example[kept], position[kept], labels[kept], source[kept]
    if packing:
        block, offset = _pack(lengths[scored], seq_len)
        row, col = np.full(len(lengths), -1), np.zeros(len(lengths), np.int64)
        row[scored], col[scored] = block, offset
        rows = int(block[-1]) + 1 if len(block) else 0
    else:
        row = np.cumsum(scored) - 1
        col = np.zeros(len(lengths), np.int64)
        rows = int(scored.sum())
    at = (row[example], col[example] + position)
    arrays = {"input_ids": np.full((rows, seq_len), pad_id, np.int32),
              "labels": np.full((rows, seq_len), IGNORE_INDEX, np.int32),
              "attention_mask": np.zeros((rows, seq_len), np.int8)}
    arrays["input_ids"][at] = flat_ids[source]
    arrays["labels"][at] = labels
    arrays["attention_mask"][at] = 1
    if packing:
        # Padding gets positions of its own (0, 0, ...: no run of +1 steps), so it joins no example.
        arrays["position_ids"] = np.zeros((rows, seq_len), np.int32)
        arrays["position_ids"][at] = position
    return arrays


# ---- data module
class SFTDataModule(pl.LightningDataModule):
    """One dataset, or a mixture (``data.datasets``): training draws each example from source i with
    probability weight_i / sum(weights) (``datasets.interleave_datasets``, seeded) until every source has been
    seen whole; each source keeps its own validation set, so the validation loss is reported per source
    (``val_names``, in the order of the validation loaders) and overall."""

    def __init__(self, cfg: RecipeConfig, tokenizer):
        super().__init__()
        self.cfg, self.tokenizer = cfg, tokenizer
        self.train_dataset: Optional[BlockDataset] = None
        self.val_datasets: Dict[str, BlockDataset] = {}
        self.stats: Dict[str, Any] = {}

    @property
    def val_dataset(self) -> Optional[BlockDataset]:
        """The validation blocks of a single dataset (None without validation data)."""
        return next(iter(self.val_datasets.values()), None)

    @property
    def val_names(self) -> List[str]:
        return list(self.val_datasets)

    def _raw_splits(self, d: SourceConfig, prefix: str):
        seed = self.cfg.trainer.seed
        if d.train_files:
            train = load_local(d.train_files, d, f"{prefix}.train_files")
        else:
            train = load_hub(d, d.split)
        if d.val_files:
            val = load_local(d.val_files, d, f"{prefix}.val_files")
        elif d.dataset and not d.train_files and d.val_split:
            val = load_hub(d, d.val_split)
        elif d.val_fraction > 0:
            if len(train) < 2:
                raise ShardlightError(f"{prefix}.val_fraction={d.val_fraction} needs at least 2 training rows, "
                                      f"got {len(train)}")
            n_val = min(len(train) - 1, max(1, round(len(train) * d.val_fraction)))
            split = train.train_test_split(test_size=n_val, seed=seed, shuffle=True, keep_in_memory=True)
            train, val = split["train"], split["test"]
        else:
            val = None
        return train, val

    def _tokenize(self, ds, d: SourceConfig, source: str):
        import datasets

        check_columns(list(ds.column_names), d, source)
        features = datasets.Features({k: datasets.Sequence(datasets.Value("int32")) for k in ("input_ids", "labels")})
        return ds.map(_Encoder(self.tokenizer, d), batched=True, remove_columns=ds.column_names,
                      features=features, keep_in_memory=True, load_from_cache_file=False, desc=f"tokenizing {source}")

    def _data_digests(self) -> List[object]:
        """What the data is: each local file's content, or a hub dataset's own fingerprint."""
        digests: List[object] = []
        for _, prefix, d in self.cfg.data.sources():
            listed = ((f"{prefix}.train_files", d.train_files), (f"{prefix}.val_files", d.val_files))
            digests += [[file_digest(p) for p in expand_files(list(files), key)] for key, files in listed]
            if not d.train_files:
                digests.append(load_hub(d, d.split)._fingerprint)
                if d.val_split:
                    digests.append(load_hub(d, d.val_split)._fingerprint)
        return digests

    def _prepare(self) -> Tuple[Splits, Dict[str, Any]]:
        """Read, tokenize, mix and block the data (one process; the others read what it wrote)."""
        import datasets

        d = self.cfg.data
        pad_id = self.tokenizer.pad_token_id
        if pad_id is None:
            pad_id = self.tokenizer.eos_token_id
        bars = not datasets.are_progress_bars_disabled()
        datasets.disable_progress_bars()  # one line says what happened instead
        try:
            trains, splits, val_examples = [], {}, 0
            sources = d.sources()
            for i, (name, prefix, source) in enumerate(sources):
                label = "" if len(sources) == 1 else f" of {prefix}"
                train, val = self._raw_splits(source, prefix)
                train = self._tokenize(train, source, "training data" + label)
                trains.append(train.add_column("source", [i] * len(train)))
                if val is not None:
                    val_examples += len(val)
                    val = self._tokenize(val, source, "validation data" + label)
                    splits[f"val/{name}"] = make_blocks(val, d.seq_len, pad_id, d.packing)
            if len(trains) == 1:
                train = trains[0]
            else:
                weights = [source.weight for _, _, source in sources]
                train = datasets.interleave_datasets(trains, probabilities=[w / sum(weights) for w in weights],
                                                     seed=self.cfg.trainer.seed, stopping_strategy="all_exhausted")
            splits["train"] = make_blocks(train, d.seq_len, pad_id, d.packing)
        finally:
            if bars:
                datasets.enable_progress_bars()
        drawn = np.bincount(np.asarray(train["source"]), minlength=len(sources)).tolist()
        stats = {"train_examples": len(train), "train_sequences": len(splits["train"]["input_ids"]),
                 "val_examples": val_examples,
                 "val_sequences": sum(len(a["input_ids"]) for k, a in splits.items() if k.startswith("val/")),
                 "train_examples_by_source": {name: n for (name, _, _), n in zip(sources, drawn)}}
        return splits, stats

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_dataset is not None:  # idempotent: fit, then validate, reuse the same blocks
            return
        d = self.cfg.data
        key = entry_key(self.cfg, self.tokenizer, self._data_digests())
        splits, self.stats, said = load_or_build(cache_root(self.cfg), key, self._prepare)
        if self.trainer is None or self.trainer.is_global_zero:
            print(said, flush=True)
        self.train_dataset = BlockDataset(splits["train"])
        self.val_datasets = {name.split("/", 1)[1]: BlockDataset(arrays) for name, arrays in splits.items()
                             if name.startswith("val/") and len(arrays["input_ids"])}
        # Ranks that read different batches: the TP ranks of one data-parallel group read the same one.
        sampler = getattr(getattr(self.trainer, "strategy", None), "distributed_sampler_kwargs", None) or {}
        world = int(sampler.get("num_replicas", getattr(self.trainer, "world_size", 1) if self.trainer else 1))
        need = self.cfg.trainer.micro_batch_size * world
        if len(self.train_dataset) < need:
            raise ShardlightError(
                f"training data gives {len(self.train_dataset)} sequences of {d.seq_len} tokens, fewer than one "
                f"batch (trainer.micro_batch_size={self.cfg.trainer.micro_batch_size} x {world} data-parallel "
                "ranks); "
                "add data, lower data.seq_len or micro_batch_size")

    def _loader(self, dataset: Dataset, train: bool) -> DataLoader:
        workers = self.cfg.data.num_workers
        generator = torch.Generator().manual_seed(self.cfg.trainer.seed) if train else None
        loader_cls = ResumableDataLoader if train else DataLoader
        return loader_cls(dataset, batch_size=self.cfg.trainer.micro_batch_size, shuffle=train,
                          generator=generator, drop_last=train, num_workers=workers,
                          persistent_workers=workers > 0, pin_memory=torch.cuda.is_available())

    def train_dataloader(self) -> DataLoader:
        if self.train_dataset is None:
            self.setup("fit")
        return self._loader(self.train_dataset, train=True)

    def val_dataloader(self):
        """One loader, one per source of a mixture (in ``val_names`` order), or, without validation data (no
        val_files / val_split and val_fraction 0), an empty list, which Lightning skips."""
        if self.train_dataset is None:
            self.setup("validate")
        loaders = [self._loader(ds, train=False) for ds in self.val_datasets.values()]
        return loaders[0] if len(loaders) == 1 else loaders
