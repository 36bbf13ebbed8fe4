"""Run one of Megatron-LM's own tools on a CPU-only machine: `python megatron_lm_tool.py MEGATRON_LM TOOL ARGS...`.

Megatron-LM's tools/preprocess_data.py imports megatron.training, whose initialize.py imports the
batch-invariant kernels module, which needs triton (GPU only). Preprocessing never calls those kernels, so
that one module is replaced by a stand-in whose functions raise if called; everything else is Megatron-LM's.
The test that uses this pins the commit it was checked with (tests/data/test_preprocess_megatron_bytes.py).
"""
import runpy
import sys
import types

KERNELS = "megatron.core.transformer.custom_layers.batch_invariant_kernels"


def _stand_in(name):
    if name.startswith("__"):
        raise AttributeError(name)

    def unavailable(*args, **kwargs):
        raise RuntimeError(f"{KERNELS}.{name} needs triton, which this CPU-only run replaced")
    return unavailable


if __name__ == "__main__":
    stand_in = types.ModuleType(KERNELS)
    stand_in.__getattr__ = _stand_in
    sys.modules[KERNELS] = stand_in
    root, tool = sys.argv[1], sys.argv[2]
    sys.path.insert(0, root)
    sys.argv = [tool, *sys.argv[3:]]
    runpy.run_path(tool, run_name="__main__")
