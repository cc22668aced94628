"""What a plan is made of, validated: the cluster (nodes, GPUs, their memory, the links between them, peak
FLOPs and the MFU to expect) and the workload (batch, sequence, precision, optimizer, LoRA). ``estimate``
costs a strategy on them; ``plan``, ``profile`` and the calibration read them."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional

from shardlight.errors import ShardlightError

# The optimizers the planner costs: the recipe's optim.name values, what training builds.
from shardlight.recipe.schema import OPTIMIZERS

GB = 1e9

# Effective (bus) bandwidth in GB/s. Intra-node: per GPU. Inter-node: per node, shared by its GPUs.
INTRA_NODE_BW = {"nvswitch": 300.0, "nvlink": 150.0, "pcie": 20.0}
INTER_NODE_BW = {"infiniband": 320.0, "ethernet": 10.0}  # 8x400 Gb/s HDR/NDR at 80%; 100 GbE at 80%
DEFAULT_INTRA, DEFAULT_INTER = "nvswitch", "infiniband"

DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}
PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "16-mixed", "16-true")
PEFT_PLANNED = (None, "lora", "qlora")


def parse_memory(text: Any, what: str = "GPU memory") -> float:
    """'80GB', '80 GiB', '141G', '40000MB', 80 → bytes. Bare numbers are GB (10^9)."""
    units = {"": GB, "b": 1, "kb": 1e3, "mb": 1e6, "gb": GB, "g": GB, "tb": 1e12, "t": 1e12,
             "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in units:
        raise ShardlightError(f"{what} '{text}' does not parse; use e.g. 80GB, 141GB, 24GiB")
    value = float(match.group(1)) * units[match.group(2).lower()]
    if value <= 0:
        raise ShardlightError(f"{what} must be positive, got '{text}'")
    return value


@dataclass
class Cluster:
    nodes: int = 1
    gpus_per_node: int = 8
    gpu_memory_bytes: float = 80 * GB
    intra_node: str = DEFAULT_INTRA
    inter_node: str = DEFAULT_INTER
    intra_node_bw: float = INTRA_NODE_BW[DEFAULT_INTRA]   # GB/s per GPU
    inter_node_bw: float = INTER_NODE_BW[DEFAULT_INTER]   # GB/s per node
    peak_tflops: float = 989.0
    mfu: float = 0.4
    usable_fraction: float = 0.9        # of GPU memory, the rest for the allocator's fragmentation
    overhead_bytes: float = 1.0 * GB    # CUDA context, NCCL buffers, kernels
    host_memory_bytes: float = 1e12     # host RAM per node, for CPU offload

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def usable_bytes(self) -> float:
        return self.gpu_memory_bytes * self.usable_fraction - self.overhead_bytes

    def to_json(self) -> Dict[str, Any]:
        data = asdict(self)
        data.update(world_size=self.world_size, gpu_memory_gb=self.gpu_memory_bytes / GB,
                    usable_gb=self.usable_bytes / GB)
        return data


def make_cluster(nodes: int = 1, gpus_per_node: int = 8, gpu_memory: Any = "80GB",
                 interconnect: Optional[List[str]] = None, intra_node_bw: Optional[float] = None,
                 inter_node_bw: Optional[float] = None, peak_tflops: float = 989.0, mfu: float = 0.4,
                 overhead_gb: float = 1.0, host_memory: Any = "1TB") -> Cluster:
    """A validated Cluster; interconnect names set the link they describe (nvlink|nvswitch|pcie inside a
    node, infiniband|ethernet between nodes); explicit bandwidths win."""
    for name, value in (("--nodes", nodes), ("--gpus-per-node", gpus_per_node)):
        if not isinstance(value, int) or value <= 0:
            raise ShardlightError(f"{name} must be a positive integer, got {value}")
    for name, value in (("--peak-tflops", peak_tflops), ("--intra-node-bw", intra_node_bw),
                        ("--inter-node-bw", inter_node_bw)):
        if value is not None and not value > 0:
            raise ShardlightError(f"{name} must be positive, got {value}")
    if not 0 < mfu <= 1:
        raise ShardlightError(f"--mfu must be in (0, 1], got {mfu}")
    if overhead_gb < 0:
        raise ShardlightError(f"--overhead-gb must not be negative, got {overhead_gb}")
    cluster = Cluster(nodes=nodes, gpus_per_node=gpus_per_node, gpu_memory_bytes=parse_memory(gpu_memory),
                      peak_tflops=float(peak_tflops), mfu=float(mfu), overhead_bytes=overhead_gb * GB,
                      host_memory_bytes=parse_memory(host_memory, "host memory"))
    for item in interconnect or []:
        for name in filter(None, (n.strip().lower() for n in str(item).split(","))):
            if name in INTRA_NODE_BW:
                cluster.intra_node, cluster.intra_node_bw = name, INTRA_NODE_BW[name]
            elif name in INTER_NODE_BW:
                cluster.inter_node, cluster.inter_node_bw = name, INTER_NODE_BW[name]
            else:
                known = ", ".join([*INTRA_NODE_BW, *INTER_NODE_BW])
                raise ShardlightError(f"unknown interconnect '{name}'; known: {known}")
    if intra_node_bw is not None:
        cluster.intra_node, cluster.intra_node_bw = "custom", float(intra_node_bw)
    if inter_node_bw is not None:
        cluster.inter_node, cluster.inter_node_bw = "custom", float(inter_node_bw)
    if cluster.usable_bytes <= 0:
        raise ShardlightError(f"GPU memory {gpu_memory} leaves nothing after {overhead_gb} GB of runtime overhead")
    return cluster


@dataclass
class Workload:
    micro_batch_size: int = 1
    seq_len: int = 2048
    accumulate_grad_batches: int = 1
    precision: str = "bf16-mixed"
    param_dtype: str = "float32"      # storage dtype of the weights (recipe model.dtype)
    optimizer: str = "adamw"
    prefetch: int = 1                  # all-gathers in flight ahead of the running unit (BACKWARD_PRE)
    attn_implementation: str = "sdpa"
    peft: Optional[str] = None         # None: full fine-tuning; lora | qlora: rank-lora_r adapters, base frozen
    lora_r: int = 16
    fsdp_version: int = 1
    loss_chunks: int = 1               # trainer.loss_chunks: the output projection and loss in pieces
    checkpointing_mode: str = "full"   # fsdp.activation_checkpointing_mode, where a row checkpoints
    checkpointing_every: int = 1       # fsdp.activation_checkpointing_every

    def validate(self) -> None:
        for name in ("micro_batch_size", "seq_len", "accumulate_grad_batches", "loss_chunks", "checkpointing_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ShardlightError(f"{name.replace('_', '-')} must be a positive integer, got {value}")
        if self.checkpointing_mode not in ("full", "selective"):
            raise ShardlightError(f"checkpointing mode '{self.checkpointing_mode}' is not one of full, selective")
        if self.precision not in PRECISIONS:
            raise ShardlightError(f"precision '{self.precision}' is not one of {', '.join(PRECISIONS)}")
        if self.param_dtype not in DTYPE_BYTES:
            raise ShardlightError(f"parameter dtype '{self.param_dtype}' is not one of float32, bfloat16, float16")
        if self.optimizer not in OPTIMIZERS:
            raise ShardlightError(f"optimizer '{self.optimizer}' is not one of {', '.join(OPTIMIZERS)}")
        if self.prefetch < 0:
            raise ShardlightError("prefetch must not be negative")
        if self.peft not in PEFT_PLANNED:
            raise ShardlightError(f"--peft '{self.peft}' is not one of none, {', '.join(PEFT_PLANNED[1:])}")
        if not isinstance(self.lora_r, int) or self.lora_r <= 0:
            raise ShardlightError(f"--lora-r must be a positive integer, got {self.lora_r}")
        if self.peft == "qlora":
            raise ShardlightError("the planner does not cost 4-bit bases (qlora) yet; plan with --peft lora")

    @property
    def compute_bytes(self) -> int:
        return 4 if self.precision.startswith("32") else 2

    @property
    def storage_bytes(self) -> int:
        return 2 if self.precision.endswith("-true") and self.compute_bytes == 2 else DTYPE_BYTES[self.param_dtype]

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.micro_batch_size * self.seq_len

