"""Nothing in a checkpoint executes: a pickle payload in any kind of checkpoint file is refused by name by
every tool that reads that kind of file, and never runs.

The payload is what an attacker would plant: the file's real content plus one object whose unpickling
calls os.mkdir(marker). Before the checkpoint loads went through weights_only, it ran under
pretrain_gpt.py --load (layer, model-states and random-generator files), tools/evaluate.py (layer and
model-states files) and convert_checkpoint.py reshard (model-states files).
"""
import os
import shutil

import pytest
import torch

from tests.checkpoint.conftest import MODEL, data_args, error_line, pretrain_in_one_process, run_tool

pytestmark = pytest.mark.slow

TAG = "iter_0000002"
FILES = {
    "layer": "layer_01-model_00-model_states.pt",
    "model-states": "mp_rank_00_model_states.pt",
    "zero": "zero_pp_rank_0_mp_rank_00_optim_states.pt",
    "rng": "rng_rank_00000.pt",
}


class Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (self.marker,)


@pytest.fixture(scope="module")
def poisoned(zero1_run, tmp_path_factory):
    """kind -> (checkpoint copy with a payload in that kind of file, the marker the payload would create)."""
    out = {}
    for kind, name in FILES.items():
        root = tmp_path_factory.mktemp(f"poisoned-{kind}")
        ckpt = shutil.copytree(zero1_run, root / "ckpt")
        path = os.path.join(ckpt, TAG, name)
        content = torch.load(path, weights_only=False)  # our own, trusted file
        marker = str(root / "payload-ran")
        content["x"] = Payload(marker)
        torch.save(content, path)
        out[kind] = (str(ckpt), marker)
    return out


def _pretrain(ckpt, corpus, tmp_path):
    return pretrain_in_one_process(corpus, ["--train-iters", "3", "--zero-stage", "1", "--load", ckpt,
                                            "--override-opt-param-scheduler"])


def _evaluate(ckpt, corpus, tmp_path):
    return run_tool("tools/evaluate.py", "--load", ckpt, "--eval-iters", "1", check=False)


def _reshard(ckpt, corpus, tmp_path):
    # The same layout, so that the random-generator files are carried over too.
    return run_tool("tools/convert_checkpoint.py", "reshard", "--load", ckpt, "--save", str(tmp_path / "out"),
                    "--target-tensor-model-parallel-size", "1", "--target-pipeline-model-parallel-size", "1",
                    check=False)


def _merge(ckpt, corpus, tmp_path):
    return run_tool("tools/convert_checkpoint.py", "merge", "--load", ckpt, "--output", str(tmp_path / "m.pt"),
                    check=False)


def _export(ckpt, corpus, tmp_path):
    return run_tool("tools/convert_checkpoint.py", "export-hf", "--load", ckpt, "--output", str(tmp_path / "hf"),
                    check=False)


def _generate(ckpt, corpus, tmp_path):
    return run_tool("tools/generate.py", "--load", ckpt, "--prompt", "def", "--max-new-tokens", "2", check=False)


TOOLS = {"pretrain --load": _pretrain, "evaluate": _evaluate, "reshard": _reshard, "merge": _merge,
         "export-hf": _export, "generate": _generate}
# Which kinds of file each tool reads (the others it never opens, so a payload there cannot matter to it).
READS = {
    "pretrain --load": ("layer", "model-states", "zero", "rng"),
    "evaluate": ("layer", "model-states"),  # at the checkpoint's own layout: DeepSpeed's loader, weights only
    "reshard": ("model-states", "zero", "rng"),  # the fp32 masters come from the ZeRO files, not the layer files
    "merge": ("layer",),
    "export-hf": ("layer",),
    "generate": ("layer",),
}
CASES = [(tool, kind) for tool, kinds in READS.items() for kind in kinds]


@pytest.mark.parametrize("tool, kind", CASES, ids=[f"{t}-{k}" for t, k in CASES])
def test_a_pickle_payload_is_refused_by_name_and_never_runs(tool, kind, poisoned, corpus, tmp_path):
    ckpt, marker = poisoned[kind]
    if os.path.exists(marker):  # left by another tool's case (when it failed): each case starts clean
        os.rmdir(marker)
    result = TOOLS[tool](ckpt, corpus, tmp_path)
    assert not os.path.exists(marker), f"{tool} ran the payload planted in the {kind} file"
    line = error_line(result)
    assert FILES[kind] in line and "refused" in line and "posix.mkdir" in line, line
    assert not (tmp_path / "out").exists() and not (tmp_path / "m.pt").exists() and not (tmp_path / "hf").exists()


def test_pretrain_gpt_as_a_process_of_its_own_refuses_a_payload_with_exit_2(poisoned, corpus, tmp_path):
    """The cases above run pretrain_gpt.py's main on a warm rank; this one is the real process, whose exit
    code is the interpreter's: it once printed its refusal and then aborted (exit -6) as it ended
    (megatron_lite/process_end.py says why)."""
    from tests.artefacts import run_tool as run_in_a_new_process

    ckpt, marker = poisoned["layer"]
    result = run_in_a_new_process("pretrain_gpt.py", *MODEL, *data_args(corpus), "--train-iters", "3",
                                  "--zero-stage", "1", "--load", ckpt, "--override-opt-param-scheduler",
                                  check=False)
    assert not os.path.exists(marker)
    line = error_line(result)
    assert FILES["layer"] in line and "refused" in line, line

