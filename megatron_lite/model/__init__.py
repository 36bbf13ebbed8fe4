"""The network: the GPT's pipeline specs, the transformer block, attention and positions, MLP and MoE, built
from parallel/ layers; no process-group calls. What it costs: cost/."""
