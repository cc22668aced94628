"""shardlight: recipe-driven FSDP fine-tuning of Hugging Face models with Lightning."""

__version__ = "0.1.0"
