"""The MLP's activation flags (model/activation.py): one gated unit at most, and the gated units' own options
only with one of them."""
from __future__ import annotations

from megatron_lite.config import ConfigError


def check_activation(m) -> None:
    if m.swiglu and m.quick_geglu:
        raise ConfigError("--swiglu and --quick-geglu each choose the gated MLP's activation (silu, or gpt-oss's "
                          "quick-GeLU); drop one of them", code="two_gated_activations")
    if m.openai_gelu and m.gated_linear_unit:
        gated = "--swiglu gates with SiLU" if m.swiglu else "--quick-geglu gates with quick-GeLU"
        raise ConfigError(f"--openai-gelu chooses GeLU's approximation, but {gated} and has no GeLU; "
                          f"drop one of them", code="openai_gelu_with_gated_mlp")
    if m.gated_linear_unit:
        return
    if m.glu_linear_offset != 0.0:
        raise ConfigError(f"--glu-linear-offset {m.glu_linear_offset:g} is added to a gated MLP's up half, but this "
                          f"MLP is not gated (GeLU); add --quick-geglu (gpt-oss: --glu-linear-offset 1) or --swiglu, "
                          f"or drop --glu-linear-offset", code="glu_option_without_gated_mlp")
    if m.activation_func_clamp_value is not None:
        raise ConfigError(f"--activation-func-clamp-value {m.activation_func_clamp_value:g} clamps a gated MLP's "
                          f"gate and up halves, but this MLP is not gated (GeLU); add --quick-geglu (gpt-oss: "
                          f"--activation-func-clamp-value 7) or --swiglu, or drop --activation-func-clamp-value",
                          code="glu_option_without_gated_mlp")
