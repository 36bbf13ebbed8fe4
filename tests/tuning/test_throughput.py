"""The throughput model's context-parallel term: two all-to-alls per layer and direction, each rank
sending (C-1)/C of the bytes, over NVLink while TP x CP fits a node and the network beyond."""
import pytest

from megatron_lite.tuning.throughput import Hardware, predict_step_seconds

HW = Hardware(gpus_per_node=8, peak_tflops=100.0, intra_node_gbps=100.0, inter_node_gbps=10.0)
A = 3e8  # bytes of one layer's forward all-to-all tensors on a rank


def _stage_seconds(tp, cp, all_to_all_bytes, recomputed=0, layers=4):
    return predict_step_seconds([1e9], [layers], [10 ** 8], HW, hidden=1024, seq=4096, tp=tp, pp=1, dp=1,
                                micro=1, gas=1, zero_stage=0, recompute_flops=[0.0], cpu_offload=False, cp=cp,
                                cp_all_to_all_bytes=all_to_all_bytes, recomputed_layers=[recomputed])["stage_seconds"]


@pytest.mark.parametrize("tp, cp, gbps", [(1, 2, 100.0), (4, 2, 100.0), (2, 4, 100.0), (8, 2, 10.0), (4, 4, 10.0)])
def test_cp_all_to_alls_cost_two_per_layer_and_direction_over_the_link_the_cp_group_spans(tp, cp, gbps):
    expected = 4 * 2 * (cp - 1) / cp * A / (gbps * 1e9)  # 4 layers, forward + backward
    assert _stage_seconds(tp, cp, A) - _stage_seconds(tp, cp, 0) == pytest.approx(expected)


def test_full_recompute_runs_the_forward_all_to_alls_again():
    forward = (2 - 1) / 2 * A / 100e9  # one layer's forward all-to-alls at CP 2
    assert _stage_seconds(1, 2, A, recomputed=4) - _stage_seconds(1, 2, A) == pytest.approx(4 * forward)


def test_cp_splits_the_compute_and_tp_traffic_of_a_micro_batch():
    """Tokens per rank are seq / CP: compute and TP all-reduces shrink (gemm efficiency aside)."""
    one, two = _stage_seconds(2, 1, 0), _stage_seconds(2, 2, 0)
    assert 0.5 * one < two < 0.6 * one
