"""MFU estimate: the FLOPs of one transformer row (FlopCounterMode once), the iteration's TFLOPS and the MFU metric;
the peak table."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from trl_flow.engine import throughput
from trl_flow.models import index_embeds


def test_peak_table_matches_device_names():
    assert throughput.peak_tflops_for("NVIDIA H100 80GB HBM3") == 989.0
    assert throughput.peak_tflops_for("NVIDIA H100 PCIe") == 756.0
    assert throughput.peak_tflops_for("NVIDIA H200") == 989.0
    assert throughput.peak_tflops_for("NVIDIA A100-SXM4-80GB") == 312.0
    assert throughput.peak_tflops_for("NVIDIA L40S") == 362.0
    assert throughput.peak_tflops_for("NVIDIA L40") == 181.0
    assert throughput.peak_tflops_for("NVIDIA L4") == 121.0
    assert throughput.peak_tflops_for("Some Future GPU") is None
    assert throughput.device_peak_tflops("cpu") is None and throughput.device_peak_tflops("cpu", 2.5) == 2.5


def test_flops_per_row_is_flop_counter_of_a_transformer_forward(make_trainer):
    trainer = make_trainer(guidance_scale=4.5)  # CFG: the probe still counts per row
    adapter = trainer.adapter
    embeds = trainer.encode(["a cat", "a red dog"], 4.5)
    x = adapter.initial_noise(2, 32, 32, torch.Generator().manual_seed(0))
    t = adapter.schedule(4, 32, 32).timesteps[0]
    per_row = throughput.flops_per_row(adapter, trainer.model, x[:1], t, index_embeds(embeds, slice(0, 1)),
                                       trainer._autocast)
    with torch.no_grad(), FlopCounterMode(display=False) as direct:  # the transformer itself, 2 rows
        trainer.pipe.transformer(hidden_states=x, encoder_hidden_states=embeds["prompt_embeds"],
                                 pooled_projections=embeds["pooled_prompt_embeds"], timestep=t.expand(2))
    assert per_row > 0 and per_row * 2 == direct.get_total_flops()


@pytest.mark.parametrize("peak", [None, 0.5])
def test_iteration_logs_tflops_and_mfu_where_the_peak_is_known(make_trainer, peak):
    trainer = make_trainer(max_steps=1, peak_tflops=peak)
    trainer.train()
    log = trainer.state.log_history[0]
    rows_rollout = log["calls/rollout_transformer"] * 4  # chunks of 4 rows, guidance 1: one pass
    rows_update = log["calls/update_transformer"] * 4  # beta = 0: every update forward has a gradient
    assert log["throughput/tflop"] == pytest.approx(trainer._flops_per_row * (rows_rollout + 3 * rows_update) / 1e12)
    assert log["throughput/tflops"] > 0
    if peak is None:  # a CPU: no peak, no MFU
        assert "throughput/mfu" not in log
    else:
        assert log["throughput/mfu"] == pytest.approx(log["throughput/tflops"] / peak)
