"""The typed recipe schema: one dataclass per section, every field's help text and allowed values in its
metadata (``help``; ``allowed``: the allowed values; number ranges ``positive`` (> 0), ``non_negative``,
``fraction`` ([0, 1)), ``min`` / ``max`` (inclusive); ``length`` of a list; null passes; see
``validate.RULES``). Every int/float field has a range. The loader, the validator and the README's reference
table all read them from here."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from shardlight.recipe.instrument_sections import CallbacksConfig, DiagnosisConfig


@dataclass
class ModelConfig:
    name_or_path: Optional[str] = field(
        default=None, metadata={"help": "Local directory or Hugging Face hub id, loaded with from_pretrained."}
    )
    config: Optional[Dict[str, Any]] = field(
        default=None,
        metadata={"help": "Inline Hugging Face architecture config (needs model_type); builds with from_config."},
    )
    dtype: str = field(
        default="float32",
        metadata={
            "allowed": ("float32", "bfloat16", "float16"),
            "help": "Weight dtype at load: float32, bfloat16, float16.",
        },
    )
    trust_remote_code: bool = field(default=False, metadata={"help": "Run code shipped with the model repo."})
    attn_implementation: Optional[str] = field(
        default="sdpa",
        metadata={
            "allowed": (None, "eager", "sdpa", "flash_attention_2", "flex_attention"),
            "help": "eager, sdpa or flash_attention_2 (null: transformers' choice).",
        },
    )
    router_aux_loss_coef: Optional[float] = field(
        default=None,
        metadata={"non_negative": True,
                  "help": "Weight of a mixture-of-experts router's load-balancing loss, added to the token loss "
                          "(null: the model config's own, e.g. router_aux_loss_coef; 0: off, for bias-balanced "
                          "routers such as DeepSeek-V3's)."},
    )


@dataclass
class TokenizerConfig:
    name_or_path: Optional[str] = field(
        default=None, metadata={"help": "Tokenizer directory or hub id; null uses model.name_or_path."}
    )
    trust_remote_code: bool = field(default=False, metadata={"help": "Run code shipped with the tokenizer repo."})


@dataclass
class SourceConfig:
    """Where one dataset's rows are and how they read: the data section's own keys (one dataset), or each item
    of ``data.datasets`` (a mixture)."""

    train_files: List[str] = field(
        default_factory=list, metadata={"help": "Local JSONL/JSON/CSV/Parquet/text files (relative to the recipe)."}
    )
    val_files: List[str] = field(default_factory=list, metadata={"help": "Local validation files."})
    dataset: Optional[str] = field(default=None, metadata={"help": "Hub dataset name, used when train_files is empty."})
    dataset_config: Optional[str] = field(default=None, metadata={"help": "Hub dataset configuration name."})
    split: str = field(default="train", metadata={"help": "Training split of the hub dataset."})
    val_split: Optional[str] = field(default=None, metadata={"help": "Validation split of the hub dataset."})
    val_fraction: float = field(
        default=0.05,
        metadata={"fraction": True, "help": "Held-out fraction of the training rows when no validation data is given."},
    )
    format: str = field(
        default="instruction",
        metadata={"allowed": ("text", "instruction", "chat"), "help": "text, instruction or chat."},
    )
    text_field: str = field(default="text", metadata={"help": "Column with raw text (format: text)."})
    prompt_field: str = field(default="prompt", metadata={"help": "Column with the prompt (format: instruction)."})
    response_field: str = field(default="response", metadata={"help": "Column with the answer (format: instruction)."})
    messages_field: str = field(default="messages", metadata={"help": "Column with chat messages (format: chat)."})
    prompt_template: str = field(
        default="### Instruction:\n{prompt}\n\n### Response:\n",
        metadata={"help": "Template wrapped around the prompt; must contain {prompt}."},
    )


@dataclass
class MixtureSource(SourceConfig):
    """One dataset of a mixture (``data.datasets``)."""

    name: Optional[str] = field(
        default=None, metadata={"help": "Its name in the logs (val/loss/<name>); null: its first file's or dataset's."}
    )
    weight: float = field(
        default=1.0, metadata={"positive": True, "help": "Its share of the training examples, relative to the others."}
    )


@dataclass
class DataConfig(SourceConfig):
    datasets: List[MixtureSource] = field(
        default_factory=list,
        metadata={"help": "A mixture: several datasets, each with the keys above (its own files or hub dataset, "
                          "format and fields) plus name and weight, instead of the single dataset's keys."},
    )
    chat_template: Optional[str] = field(
        default=None,
        metadata={"help": "Chat template: a Jinja string, a file (relative to the recipe) or 'tokenizer' (its own); "
                          "null: the tokenizer's own, else a plain built-in one. The export carries it."},
    )
    seq_len: int = field(default=256, metadata={"positive": True, "help": "Tokens per training sequence."})
    packing: bool = field(
        default=True,
        metadata={"help": "Place whole examples into seq_len blocks; attention and positions stay per example."},
    )
    num_workers: int = field(
        default=0, metadata={"non_negative": True, "help": "DataLoader worker processes per rank."}
    )
    cache_dir: Optional[str] = field(
        default=None,
        metadata={"help": "Where tokenized data is cached for restarts and the other ranks (shared: built once "
                          "per cluster); null: ~/.cache/shardlight/data."},
    )

    def sources(self) -> List[Tuple[str, str, SourceConfig]]:
        """Each dataset as (name, its keys' prefix, its keys): the data section itself, or each mixture item
        (named by ``name``, else by its first file's stem or its hub dataset's name)."""
        if not self.datasets:
            return [("data", "data", self)]
        return [(s.name or (Path(s.train_files[0]).stem if s.train_files else str(s.dataset).rsplit("/", 1)[-1]),
                 f"data.datasets[{i}]", s) for i, s in enumerate(self.datasets)]


# The optimizers training builds (shardlight.build.optimizer) and the planner costs (shardlight.planner).
OPTIMIZERS = ("adamw", "adam", "sgd", "adamw8bit")


@dataclass
class OptimConfig:
    name: str = field(
        default="adamw",
        metadata={
            "allowed": OPTIMIZERS,
            "help": "adamw, adam, sgd (momentum betas[0]) or adamw8bit (bitsandbytes, GPU); the planner's names.",
        },
    )
    lr: float = field(default=3e-4, metadata={"positive": True, "help": "Peak learning rate."})
    betas: List[float] = field(
        default_factory=lambda: [0.9, 0.95],
        metadata={"fraction": True, "length": 2, "help": "Adam(W) betas; sgd uses betas[0] as momentum."},
    )
    eps: float = field(default=1e-8, metadata={"non_negative": True, "help": "Adam(W) epsilon."})
    weight_decay: float = field(
        default=0.0, metadata={"non_negative": True, "help": "Weight decay (decoupled for adamw, L2 for adam/sgd)."}
    )
    warmup_steps: int = field(default=0, metadata={"non_negative": True, "help": "Linear warmup steps from 0 to lr."})
    schedule: str = field(
        default="cosine",
        metadata={"allowed": ("cosine", "linear", "constant"), "help": "cosine, linear or constant after warmup."},
    )
    min_lr_ratio: float = field(
        default=0.1, metadata={"min": 0, "max": 1, "help": "Final lr as a fraction of lr (cosine, linear)."}
    )


@dataclass
class TrainerConfig:
    max_steps: int = field(default=100, metadata={"positive": True, "help": "Optimizer steps to train."})
    micro_batch_size: int = field(
        default=8, metadata={"positive": True, "help": "Sequences per rank per forward pass."}
    )
    accumulate_grad_batches: int = field(
        default=1, metadata={"positive": True, "help": "Micro-batches per optimizer step."}
    )
    precision: str = field(
        default="32-true",
        metadata={
            "allowed": ("32-true", "32", "bf16-mixed", "bf16-true", "16-mixed", "16-true"),
            "help": "Lightning precision: 32-true, bf16-mixed, bf16-true, 16-mixed.",
        },
    )
    accelerator: str = field(
        default="auto", metadata={"allowed": ("auto", "cpu", "gpu", "cuda"), "help": "auto, cpu, gpu or cuda."}
    )
    devices: int = field(default=1, metadata={"positive": True, "help": "Ranks (processes) per node."})
    allow_oversubscribe: bool = field(
        default=False,
        metadata={"help": "On CPU, allow more than twice as many ranks per node as this machine has cores."},
    )
    num_nodes: int = field(default=1, metadata={"positive": True, "help": "Nodes."})
    seed: int = field(  # numpy's (and so Lightning's seed_everything's) range: uint32
        default=1234, metadata={"min": 0, "max": 2**32 - 1, "help": "Seed for weights, shuffling and dropout."}
    )
    log_every_n_steps: int = field(
        default=10, metadata={"positive": True, "help": "Logging interval in optimizer steps."}
    )
    val_every_n_steps: int = field(
        default=50, metadata={"positive": True, "help": "Validation interval in optimizer steps."}
    )
    limit_val_batches: Optional[int] = field(
        default=None, metadata={"non_negative": True, "help": "Cap on validation batches per rank (0: no validation)."}
    )
    gradient_clip_val: Optional[float] = field(
        default=1.0, metadata={"positive": True, "help": "Clip the gradient norm (null: off)."}
    )
    num_threads: Optional[int] = field(
        default=None,
        metadata={"positive": True, "help": "torch threads per rank on CPU (null: cores / ranks on the node)."},
    )
    progress_bar: bool = field(default=True, metadata={"help": "Show Lightning's progress bar on rank 0."})
    gc_freeze: bool = field(
        default=True,
        metadata={"help": "gc.freeze() the objects alive at train start, so Python's full garbage collections scan "
                          "only what training allocates (no 200+ ms pause of one rank that the others wait for)."},
    )
    collective_timeout_s: int = field(
        default=1800,
        metadata={"positive": True, "help": "Seconds a collective may wait for a dead or hung rank before failing."},
    )
    startup_timeout_s: int = field(
        default=1800,
        metadata={"positive": True,
                  "help": "Seconds the ranks may take to meet when the run starts (the slowest rank's imports and "
                          "data preparation), apart from collective_timeout_s."},
    )
    loss_chunks: int = field(
        default=1,
        metadata={"positive": True,
                  "help": "Run the output projection and the loss on this many pieces of the sequence, each "
                          "recomputed in backward: the [batch, seq, vocab] fp32 logits never exist, the loss is "
                          "the same (1: in one piece)."},
    )
    flight_recorder_entries: int = field(
        default=2000,
        metadata={"non_negative": True,
                  "help": "Collectives torch's flight recorder keeps per rank, dumped to run_dir/flight_recorder "
                          "when the run hangs (callbacks.hang) or NCCL times out (0: off)."},
    )
    on_nonfinite: str = field(
        default="stop",
        metadata={
            "allowed": ("stop", "skip"),
            "help": "A non-finite loss or gradient norm: stop (exit 1, no export) or skip that optimizer step.",
        },
    )


@dataclass
class FSDPConfig:
    """Accelerate's ``FullyShardedDataParallelPlugin`` fields, same names and meanings.

    ``null`` means Accelerate's default for the chosen ``fsdp_version``. shardlight's own defaults
    differ from Accelerate's in three places, each to hide communication better: transformer-block
    wrapping (Accelerate: NO_WRAP, a single unit), BACKWARD_PRE prefetch for FSDP1 (Accelerate:
    none) and ``use_orig_params: true`` for FSDP1 (needed for per-parameter optimizer groups).
    """

    fsdp_version: int = field(
        default=1, metadata={"allowed": (1, 2), "help": "1: FullyShardedDataParallel; 2: fully_shard (DTensor)."}
    )
    sharding_strategy: Optional[str] = field(
        default=None,
        metadata={
            "allowed": (None, "FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"),
            "help": "FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD, _HYBRID_SHARD_ZERO2 (null: FULL_SHARD).",
        },
    )
    reshard_after_forward: Optional[Any] = field(
        default=None,
        metadata={"help": "FSDP2: free gathered params after forward (true ~ FULL_SHARD, false ~ SHARD_GRAD_OP)."},
    )
    auto_wrap_policy: str = field(
        default="TRANSFORMER_BASED_WRAP",
        metadata={
            "allowed": ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP"),
            "help": "TRANSFORMER_BASED_WRAP, SIZE_BASED_WRAP or NO_WRAP.",
        },
    )
    transformer_cls_names_to_wrap: Optional[List[str]] = field(
        default=None, metadata={"help": "Block classes to wrap (null: the model's _no_split_modules)."}
    )
    transformer_layer_cls_to_wrap: Optional[List[str]] = field(
        default=None, metadata={"help": "Alias of transformer_cls_names_to_wrap (Accelerate's config name)."}
    )
    min_num_params: Optional[int] = field(
        default=None,
        metadata={"non_negative": True,
                  "help": "SIZE_BASED_WRAP: parameters per unit at least (null: 0, as Accelerate)."},
    )
    backward_prefetch: Optional[str] = field(
        default=None,
        metadata={
            "allowed": (None, "BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH"),
            "help": "FSDP1: BACKWARD_PRE, BACKWARD_POST or NO_PREFETCH (null: BACKWARD_PRE; FSDP2: invalid).",
        },
    )
    forward_prefetch: Optional[bool] = field(
        default=None,
        metadata={"help": "FSDP1: issue the next all-gather during forward (null: false; FSDP2: invalid)."},
    )
    limit_all_gathers: bool = field(default=True, metadata={"help": "FSDP1: rate-limit all-gathers in flight."})
    use_orig_params: Optional[bool] = field(
        default=None, metadata={"help": "FSDP1: keep original parameters visible (null: true; FSDP2 always does)."}
    )
    cpu_offload: bool = field(default=False, metadata={"help": "Offload parameters and gradients to CPU."})
    offload_params: Optional[bool] = field(
        default=None, metadata={"help": "Alias of cpu_offload (Accelerate's config name)."}
    )
    state_dict_type: Optional[str] = field(
        default=None,
        metadata={
            "allowed": (None, "FULL_STATE_DICT", "SHARDED_STATE_DICT"),
            "help": "FULL_STATE_DICT or SHARDED_STATE_DICT (null: FULL for FSDP1, SHARDED for FSDP2).",
        },
    )
    sync_module_states: Optional[bool] = field(
        default=None, metadata={"help": "FSDP1: broadcast rank 0's weights at wrap time (null: false)."}
    )
    cpu_ram_efficient_loading: Optional[bool] = field(
        default=None, metadata={"help": "Read pretrained safetensors into each rank's shards, never the whole "
                                        "model in one rank (null: true; false: every rank loads it all)."}
    )
    activation_checkpointing: bool = field(
        default=False, metadata={"help": "Recompute each transformer block in backward (non-reentrant)."}
    )
    activation_checkpointing_mode: str = field(
        default="full",
        metadata={"allowed": ("full", "selective"),
                  "help": "full: keep only each checkpointed block's input; selective: also keep its matmul and "
                          "attention outputs and recompute only the cheap ops (norms, activations, rotary)."},
    )
    activation_checkpointing_every: int = field(
        default=1,
        metadata={"positive": True, "help": "Checkpoint every n-th block (1: every block; 2: blocks 0, 2, 4, ...)."},
    )
    activation_checkpointing_offload: bool = field(
        default=False,
        metadata={"help": "FSDP2: move what each checkpointed block keeps (its input) to host memory until "
                          "backward, as Accelerate's activation_checkpointing_offload (a CPU run keeps it there)."},
    )
    mixed_precision: Optional[str] = field(
        default=None,
        metadata={
            "allowed": (None, "no", "bf16", "fp16", "fp32"),
            "help": "FSDP param/reduce dtype: bf16, fp16, fp32 or no (null: from trainer.precision).",
        },
    )
    mixed_precision_policy: Optional[str] = field(
        default=None, metadata={"help": "Alias of mixed_precision (Accelerate's field name)."}
    )
    sync_each_batch: bool = field(
        default=False,
        metadata={"help": "Reduce-scatter on every micro-batch under accumulation (less memory, more traffic)."},
    )
    mesh_shape: Optional[List[int]] = field(
        default=None,
        metadata={"positive": True, "length": 2,
                  "help": "HYBRID_SHARD (replicate, shard) mesh (null: (num_nodes, devices))."},
    )
    wrap_report_tiny_unit_params: int = field(
        default=1_000_000,
        metadata={"non_negative": True, "help": "Wrap report: warn when units are smaller than this."},
    )


# Module-level tensor-parallel styles a recipe plan may name (shardlight.strategy.tensor_parallel maps them to
# torch.distributed.tensor.parallel styles; the names are transformers' tp-plan strings).
TP_STYLES = ("colwise", "rowwise", "colwise_rep", "colwise_gather_output")


@dataclass
class ParallelismConfig:
    """The device mesh (dp_replicate, dp_shard, tp), Accelerate's ParallelismConfig names. With tp_size 1 and
    both dp sizes null the mesh is the fsdp: section's, as without this section."""

    tp_size: int = field(
        default=1, metadata={"positive": True, "help": "Tensor-parallel degree (innermost mesh dim, inside a node)."}
    )
    dp_replicate_size: Optional[int] = field(
        default=None,
        metadata={"positive": True,
                  "help": "HSDP replicas with tp_size > 1 (null: num_nodes for HYBRID_SHARD, else 1)."},
    )
    dp_shard_size: Optional[int] = field(
        default=None, metadata={"positive": True, "help": "FSDP shard group size (null: world / (replicate x tp))."}
    )
    cp_size: Optional[int] = field(
        default=None, metadata={"positive": True, "help": "Context parallelism: reserved, not supported yet."}
    )
    tp_plan: Optional[Dict[str, str]] = field(
        default=None,
        metadata={"help": "{module glob: style} over the HF model's module names, styles: "
                          f"{', '.join(TP_STYLES)} (null: the model's base_model_tp_plan)."},
    )
    allow_cross_node_tp: bool = field(
        default=False, metadata={"help": "Allow tp_size above trainer.devices (TP collectives across nodes)."}
    )


@dataclass
class WandbConfig:
    enabled: bool = field(default=True, metadata={"help": "Log to Weights & Biases."})
    project: str = field(default="shardlight", metadata={"help": "W&B project."})
    entity: Optional[str] = field(default=None, metadata={"help": "W&B entity (team or user)."})
    group: Optional[str] = field(default=None, metadata={"help": "W&B group."})
    name: Optional[str] = field(default=None, metadata={"help": "W&B run name (null: the run dir name)."})
    mode: Optional[str] = field(
        default=None,
        metadata={
            "allowed": (None, "online", "offline", "disabled"),
            "help": "online, offline or disabled (null: offline unless WANDB_API_KEY is set).",
        },
    )
    tags: List[str] = field(default_factory=list, metadata={"help": "W&B tags."})


@dataclass
class LoggingConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)
    csv: bool = field(default=True, metadata={"help": "Also write metrics.csv in the run dir."})


# The adapter methods training builds (shardlight.adapters); qlora loads the base in 4 bits (bitsandbytes, GPU).
PEFT_METHODS = (None, "lora", "qlora")


@dataclass
class PeftConfig:
    method: Optional[str] = field(
        default=None,
        metadata={"allowed": PEFT_METHODS,
                  "help": "null: full fine-tuning; lora: LoRA adapters (peft); qlora: LoRA on a 4-bit base (GPU)."},
    )
    r: int = field(default=16, metadata={"positive": True, "help": "LoRA rank."})
    alpha: float = field(
        default=32, metadata={"positive": True, "help": "LoRA alpha (the update is scaled by alpha / r)."}
    )
    dropout: float = field(default=0.05, metadata={"fraction": True, "help": "Dropout on the LoRA input."})
    target_modules: Optional[List[str]] = field(
        default=None, metadata={"help": "Module names to adapt (null: peft's default for the architecture)."}
    )
    modules_to_save: List[str] = field(
        default_factory=list, metadata={"help": "Modules trained in full and saved with the adapter (e.g. lm_head)."}
    )


@dataclass
class CheckpointConfig:
    enabled: bool = field(default=True, metadata={"help": (
        "Save sharded (DCP) checkpoints to run_dir/checkpoints/ (false: none, but a run that exports at its end "
        "still saves its final step first and removes it once the export verified).")})
    every_n_steps: Optional[int] = field(
        default=100, metadata={"positive": True, "help": "Optimizer steps between checkpoints (null: only at the end)."}
    )
    keep_last: Optional[int] = field(
        default=2, metadata={"positive": True, "help": "Keep this many newest checkpoints (null: all)."}
    )
    save_last: bool = field(default=True, metadata={"help": (
        "Also save when training ends (always, with export.at_end: a failed export then loses nothing).")})
    async_save: bool = field(default=False, metadata={"help": (
        "Write checkpoints in the background (dcp.async_save): a step copies its shards to host memory and "
        "training goes on while they are written; a save still running when the next is due, or at the end, "
        "is waited for.")})


@dataclass
class ExportConfig:
    at_end: bool = field(default=True, metadata={"help": (
        "Write the trained model as a Hugging Face folder to run_dir/model/ when training ends, from the shards "
        "(false: checkpoints only; shardlight export makes the folder from one later).")})
    checkpoint: bool = field(default=False, metadata={"help": (
        "Also export the final checkpoint to run_dir/export (verified), as shardlight export does.")})
    max_shard_size: str = field(default="5GB", metadata={"help": (
        "Largest safetensors file of a full-model export, as save_pretrained's max_shard_size (e.g. 5GB, 500MB).")})


@dataclass
class LaunchConfig:
    env: Dict[str, str] = field(
        default_factory=dict,
        metadata={"help": "Environment for launched jobs (e.g. NCCL_* settings); written into sbatch scripts."},
    )


@dataclass
class RecipeConfig:
    name: Optional[str] = field(default=None, metadata={"help": "Recipe name (null: the recipe file's stem)."})
    base: Optional[str] = field(default=None, metadata={"help": "Recipe merged underneath this one."})
    output_dir: str = field(default="runs", metadata={"help": "Runs go to output_dir/<name>/<timestamp>/."})
    model: ModelConfig = field(default_factory=ModelConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    callbacks: CallbacksConfig = field(default_factory=CallbacksConfig)
    diagnosis: DiagnosisConfig = field(default_factory=DiagnosisConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    compile: bool = field(
        default=False,
        metadata={"help": "torch.compile each transformer block (before checkpointing and FSDP wrap it); the "
                          "first steps pay the compile time, reported apart from the step time (compile_s)."},
    )
    resume: Optional[str] = field(
        default=None, metadata={"help": "auto (newest complete checkpoint, if any) or a checkpoint/run dir path."}
    )
    resume_dir: Optional[str] = field(
        default=None, metadata={"help": "resume=auto: the run dir to look in (null: newest run of this recipe)."}
    )
