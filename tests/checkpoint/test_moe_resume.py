"""A Mixture-of-Experts checkpoint stores every expert by its global index, so it resumes under another
expert-parallel size (and TP, DP) with its optimizer state, continuing the uninterrupted losses."""
import pytest

from tests.checkpoint.test_moe_tools import _train as train
from tests.harness import run_distributed


def _train(tp, dp, ep, extra, save=None, load=None):
    """(losses, the resume's note) of test_moe_tools' run at PP 1."""
    losses, note, _ = train(tp, 1, dp, ep, extra, save, load)
    return losses, note


@pytest.fixture(scope="module")
def saved_at_dp4_ep2(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("moe") / "ckpt")
    full, _ = run_distributed(_train, 4, 1, 4, 2, ("--zero-stage", "1"), ckpt)[0]
    return ckpt, full


@pytest.mark.parametrize("tp, dp, ep", [(1, 4, 2), (1, 4, 1), (1, 4, 4), (2, 2, 2)],
                         ids=["same-layout", "ep1", "ep4", "tp2-dp2-ep2"])
def test_moe_checkpoint_resumes_at_another_expert_parallel_size_with_the_uninterrupted_losses(saved_at_dp4_ep2, tp,
                                                                                            dp, ep):
    ckpt, full = saved_at_dp4_ep2
    resumed, note = run_distributed(_train, tp * dp, tp, dp, ep, ("--zero-stage", "1"), None, ckpt)[0]
    assert sorted(resumed) == [3, 4]
    for step in resumed:
        assert abs(resumed[step] - full[step]) / abs(full[step]) <= 1e-5, (step, resumed[step], full[step], note)
    if (tp, dp, ep) != (1, 4, 2):
        assert note.startswith("resharded TP 1 x PP 1 x DP 4 (EP 2) (ZeRO 1, fp32)"), note
