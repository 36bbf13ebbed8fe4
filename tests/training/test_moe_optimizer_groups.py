"""An MoE layer's stacked expert biases [E, n] get no weight decay, as every bias does (a stacked weight
[E, out, in] does), and the checkpoint layout's optimizer order agrees with the optimizer built."""
from megatron_lite.arguments import parse_args
from megatron_lite.checkpoint.layout import ModelLayout
from megatron_lite.model.gpt import GPTModel
from megatron_lite.training.optimizer import parameter_groups

FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--vocab-size", "64", "--micro-batch-size", "1", "--num-experts", "4", "--moe-ffn-hidden-size", "16"]


def test_expert_biases_get_no_weight_decay_and_the_layout_agrees():
    config = parse_args(FLAGS, world_size=1)[0]
    model = GPTModel(config)
    decay, no_decay = (set(map(id, g["params"])) for g in parameter_groups(model.named_parameters(), 0.1))
    names = dict(model.named_parameters())
    experts = "layers.1.mlp.experts."
    assert [id(names[experts + n]) in no_decay for n in ("bias1", "bias2")] == [True, True]
    assert [id(names[experts + n]) in decay for n in ("weight1", "weight2")] == [True, True]
    layout = ModelLayout(config)
    for spec, infos in layout.params.items():
        for info in infos:
            full = next(p for n, p in names.items() if n.startswith(f"layers.{spec}.") and n.endswith(info.name))
            assert info.decays == (id(full) in decay), (spec, info.name)
