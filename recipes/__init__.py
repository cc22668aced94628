"""The shipped recipes, tokenizer and data: package data of the wheel (shardlight.recipes)."""
