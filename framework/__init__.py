"""shardlight: recipe-driven FSDP fine-tuning of Hugging Face models with Lightning."""

__version__ = "0.1.0"


def __getattr__(name):
    # Lazy: `import framework.config` stays light; full_params pulls in torch.distributed.
    if name == "full_params":
        from framework.export import full_params

        return full_params
    raise AttributeError(f"module 'framework' has no attribute {name!r}")
