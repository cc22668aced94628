"""One rank of several Lightning fits in one gloo process group: each fit's first optimizer step's gradient,
every parameter gathered whole, and its weights after the last step. ``conftest.gloo_fits`` starts every rank
torchrun-style (LOCAL_RANK, MASTER_PORT, ...), so Lightning launches nothing: the ranks keep one gloo process
group and run the fits one after another, paying the start-up once for all of them.

A fit is ``Trainer.fit`` alone, or with ``"train": true`` the whole of ``shardlight.train.train`` (preflight,
fit, final validation, export, checkpoints, summary), whose files the test reads from the run dir.

Per run, ``"counters": true`` counts every rank's collectives and decoder-block forwards
(``workers/instrumented_train.py``'s wrappers, reset per fit) and ``"capture": true`` keeps every rank's console
(stdout and stderr at the file-descriptor level, warnings shown as a user sees them; other runs ignore warnings).

Usage: python gloo_fits.py SPEC.json OUT_DIR.
SPEC: {"runs": {name: {"recipe": path, "overrides": [...], "train": bool, "counters": bool, "capture": bool,
"full_state": bool}}}.
OUT_DIR/NAME.pt (rank 0): {"grads": {param: tensor}, "weights": {param: tensor}, "steps": n}; with ``train``
"tied_live" (the input and output embeddings one parameter in the live model after the export), "summary"
(train's) and "weights" (the full state dict with ``full_state``, else None); with ``counters`` "counts" (one dict per rank); with ``capture`` "output"
(every rank's console, rank 0's first).
"""

import contextlib
import json
import os
import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: workers.instrumented_train


class FirstStepGradients(pl.Callback):
    """The first optimizer step's gradients, each parameter whole, as every callback sees them (before clipping),
    and the micro-batches that made them (this rank's)."""

    def __init__(self) -> None:
        self.grads, self.batches = None, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.grads is None:
            self.batches.append({k: v.clone() for k, v in batch.items()})

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.grads is None:
            self.grads = whole_gradients(trainer, pl_module)


def whole_gradients(trainer, pl_module):
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.tensor import DTensor

    from shardlight.causal_lm import clean_param_name

    def named():
        return {clean_param_name(name).removeprefix("model."): p.grad
                for name, p in pl_module.named_parameters() if p.grad is not None}

    root = getattr(trainer.strategy, "_fsdp1_root", None)
    if root is not None:  # FSDP1 (original parameters): every rank gathers the full gradients
        with FullyShardedDataParallel.summon_full_params(root, with_grads=True, writeback=False):
            return {name: grad.detach().clone() for name, grad in named().items()}
    return {name: (grad.full_tensor() if isinstance(grad, DTensor) else grad).detach().clone()
            for name, grad in named().items()}


def fit(recipe: str, overrides, rank: int):
    from shardlight.build import build_datamodule, build_module, build_tokenizer, build_trainer
    from shardlight.recipe import load_recipe
    from shardlight.run_context import RunContext

    cfg = load_recipe(recipe, overrides)
    ctx = RunContext(launcher="lightning", rank=rank, launched=True, resume_decided=True,
                     run_dir=Path(cfg.output_dir) / cfg.name)
    pl.seed_everything(cfg.trainer.seed, workers=True, verbose=False)
    module = build_module(cfg)
    datamodule = build_datamodule(cfg, build_tokenizer(cfg))
    capture = FirstStepGradients()
    trainer = build_trainer(cfg, ctx, [capture])
    trainer.fit(module, datamodule=datamodule)
    weights = trainer.strategy.full_state_dict()
    weights = {k.removeprefix("model."): v for k, v in weights.items()}
    return {"grads": capture.grads, "weights": weights, "steps": trainer.global_step}


class TieProbe:
    """A ``train`` instrument: the first step's gradients, whether the live model still ties its input and
    output embeddings once the run is over (the same parameter object, as ``tie_weights`` made it), and with
    ``full_state`` the trained model's full state dict (rank 0; gathered after the export, with no step
    between)."""

    def __init__(self, full_state: bool = False) -> None:
        self.capture = FirstStepGradients()
        self.tied_live = None
        self.full_state = full_state
        self.weights = None

    def callbacks(self, cfg, ctx):
        return [self.capture]

    def after_fit(self, trainer, module, cfg, run_dir):
        model = module.model
        self.tied_live = model.get_input_embeddings().weight is model.get_output_embeddings().weight
        if self.full_state:  # every rank: a collective
            self.weights = {k: v.detach().clone() for k, v in trainer.strategy.full_state_dict().items()}
        return {}


def train_run(recipe: str, overrides, rank: int, full_state: bool = False):
    from shardlight.instruments import Measurements
    from shardlight.recipe import load_recipe
    from shardlight.run_context import RunContext
    from shardlight.train import train

    cfg = load_recipe(recipe, overrides)
    # The resume decision (cfg.resume) is train's, on every rank alike.
    ctx = RunContext(launcher="lightning", rank=rank, launched=True, run_dir=Path(cfg.output_dir) / cfg.name)
    probe = TieProbe(full_state)
    summary = train(ctx, cfg, instruments=[probe, Measurements()])  # as `shardlight train` runs it
    return {"grads": probe.capture.grads, "tied_live": probe.tied_live, "summary": summary,
            "steps": summary["steps"], "weights": probe.weights}


@contextlib.contextmanager
def console_to(path: Path):
    """This process's stdout and stderr (file descriptors 1 and 2, so native output too) into ``path``."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with open(path, "w") as sink:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)


def run_one(run, rank: int, log: Path):
    counters = None
    if run.get("counters"):
        import workers.instrumented_train as counters  # wraps the collectives and block forwards once

        counters.COUNTS.update(dict.fromkeys(counters.COUNTS, 0))
    with contextlib.ExitStack() as stack:
        stack.enter_context(warnings.catch_warnings())
        if run.get("capture"):
            stack.enter_context(console_to(log))
        else:
            warnings.simplefilter("ignore")
        if run.get("train"):
            result = train_run(run["recipe"], run["overrides"], rank, full_state=run.get("full_state", False))
        else:
            result = fit(run["recipe"], run["overrides"], rank)
    if counters is not None:
        from shardlight.collectives import all_gather_objects

        result["counts"] = all_gather_objects(dict(counters.COUNTS))
    if run.get("capture"):
        torch.distributed.barrier()
        logs = sorted(log.parent.glob(f"{log.stem.rsplit('.', 1)[0]}.rank*.log"))
        result["output"] = "".join(p.read_text() for p in logs)
    return result


def main(spec_path: str, out_dir: str) -> None:
    rank = int(os.environ["RANK"])
    spec = json.loads(Path(spec_path).read_text())
    out = Path(out_dir)
    for index, (name, run) in enumerate(spec["runs"].items()):
        result = run_one(run, rank, out / f"run{index}.rank{rank}.log")
        if rank == 0:
            torch.save(result, out / f"{name}.pt")


if __name__ == "__main__":
    main(*sys.argv[1:3])
