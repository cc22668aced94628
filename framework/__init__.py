"""shardlight: recipe-driven FSDP fine-tuning of Hugging Face models with Lightning."""

__version__ = "0.1.0"


def __getattr__(name):
    # Lazy: `import shardlight.recipe` stays light; full_params pulls in torch.distributed.
    if name == "full_params":
        from shardlight.strategy.unshard import full_params

        return full_params
    raise AttributeError(f"module 'shardlight' has no attribute {name!r}")
