"""``cache_prompt_embeds``: the text encoders run once per distinct prompt; a run with the cache is bit for bit the
run without it. Counted with forward hooks around the pipeline's own encoders and transformer."""

from __future__ import annotations

import torch

from trl_flow import FlowGRPOConfig, FlowGRPOTrainer
from trl_flow.tasks import shapes
from trl_flow.tasks.shapes import grammar, model

PROMPTS = grammar.train_prompts()["prompt"][:2]


def _train(tmp_path, cache: bool):
    config = FlowGRPOConfig(output_dir=str(tmp_path / f"cache{cache}"), height=32, width=32, max_steps=2,
                            num_inference_steps=4, num_generations=4, prompts_per_step=2,
                            per_device_train_batch_size=4, max_sequence_length=model.MAX_SEQUENCE_LENGTH,
                            guidance_scale=model.DEFAULT_GUIDANCE_SCALE, cache_prompt_embeds=cache,
                            disable_tqdm=True)
    trainer = FlowGRPOTrainer(config, model.load_base_pipeline(), [shapes.shapes_partial_reward],
                              train_dataset=list(PROMPTS))
    trainer.train()
    return trainer


def test_second_iteration_runs_no_text_encoder_and_the_run_is_unchanged(tmp_path):
    cached, plain = _train(tmp_path, True), _train(tmp_path, False)
    calls = [e["calls/text_encoder"] for e in cached.state.log_history]
    assert calls[0] > 0 and calls[1] == 0  # the same 2 prompts in iteration 2: every row from the cache
    assert all(e["calls/text_encoder"] == calls[0] for e in plain.state.log_history)  # without it: every iteration
    assert cached.state.log_history[0]["calls/rollout_transformer"] > 0
    assert cached.state.log_history[0]["calls/update_transformer"] > 0
    a = {n: p.detach() for n, p in cached.pipe.transformer.named_parameters() if "lora" in n}
    b = {n: p.detach() for n, p in plain.pipe.transformer.named_parameters() if "lora" in n}
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    for x, y in zip(cached.state.log_history, plain.state.log_history):
        assert x["reward"] == y["reward"] and x["loss"] == y["loss"]
    emb, ref = cached.encode(list(PROMPTS), 3.0), plain.encode(list(PROMPTS), 3.0)
    assert all(torch.equal(emb[k], ref[k]) for k in ref)
