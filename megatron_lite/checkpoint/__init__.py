"""Checkpoint tools: read a sharded checkpoint, merge it, reshard it, export it to Hugging Face."""
