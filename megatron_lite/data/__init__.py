"""Tokenizer, Megatron-format indexed datasets, GPT samples and blending."""
