"""Using a trained GPT: text generation and evaluation of a checkpoint."""
