"""The GPT: transformer layers built from parallel/ layers, the fused softmax, pipeline specs."""
