"""Every shipped recipe parses through the CLI into its trainer's config (every key a field or script argument,
every value arriving), the SD3.5-Medium recipes carry the papers' published values, and every CPU recipe trains
one iteration."""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
import yaml

from trl_flow import cli

RECIPES = cli.shipped("recipes")


def _raw(name):
    with open(RECIPES[name]) as f:
        return yaml.safe_load(f)


CPU_RECIPES = sorted(n for n in RECIPES if _raw(n).get("model_name_or_path") == "shapes")


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_parses_into_its_config(name):
    raw = _raw(name)
    command = raw.get("trainer")
    assert command in cli.commands(), (f"{name}: a recipe names its command with "
                                       f"`trainer: <{'|'.join(cli.commands())}>`")
    script, config, rest = cli.parse_args(command, ["--config", name])
    assert type(config) is cli.trainer_classes(command)[0] and rest == []
    fields = {f.name for f in dataclasses.fields(config)}
    for key, value in raw.items():
        got = getattr(config if key in fields else script, key)
        if key == "report_to":
            value = [] if value == "none" else [value] if isinstance(value, str) else value
        if isinstance(got, float):
            assert math.isclose(got, float(value)), (key, got, value)
        else:
            assert got == value, (key, got, value)


def test_the_shipped_recipes_cover_every_trainer_and_task():
    for method in ("flow_grpo", "op_grpo", "stepwise", "dppo"):
        for task in ("geneval", "ocr", "pickscore"):
            assert f"sd35m_{method}_{task}" in RECIPES
    assert {"shapes_flow_grpo", "shapes_op_grpo", "shapes_stepwise", "shapes_dppo", "shapes_nft"} <= set(CPU_RECIPES)


def test_sd35m_recipes_carry_the_published_settings():
    """METHODS.md: 512 px, 10 rollout / 40 eval steps, cfg 4.5, G 24, lr 3e-4, LoRA 32/64, EMA 0.9, grad clip 1;
    Flow-GRPO clip 1e-4, beta 0.04 (GenEval, OCR) / 0.01 (PickScore); OP-GRPO 25% off-policy; Stepwise ddim, T' 5.
    Flow-DPPO's and DiffusionNFT's recipes follow their released code instead (the tests below)."""
    for name in (n for n in RECIPES if n.startswith("sd35m_") and not n.startswith(("sd35m_diffusion_nft",
                                                                                    "sd35m_dppo"))):
        r = _raw(name)
        assert r["model_name_or_path"] == "stabilityai/stable-diffusion-3.5-medium" and r["bf16"] is True
        assert (r["height"], r["width"], r["num_inference_steps"], r["eval_num_inference_steps"]) == (512, 512, 10, 40)
        assert (r["guidance_scale"], r["num_generations"], float(r["learning_rate"])) == (4.5, 24, 3e-4)
        assert (r["lora_r"], r["lora_alpha"], r["ema_decay"], r["max_grad_norm"]) == (32, 64, 0.9, 1.0)
        method, task = name[len("sd35m_"):].rsplit("_", 1)
        assert float(r["clip_range"]) == 1e-4 and r["beta"] == (0.01 if task == "pickscore" else 0.04)
        if method != "stepwise":
            assert (r["sampler"], r["noise_level"]) == ("flow_sde", 0.7)
        else:  # the paper's kernel and T' (the config's default T' is 2, measured equal on shapes)
            assert r["sampler"] == "ddim" and r["num_substeps"] == 5
        if method == "op_grpo":
            assert r["off_policy_fraction"] == 0.25 and r["off_policy_correction"] == "sequence"
        assert r["reward_funcs"] == {"geneval": ["http://127.0.0.1:18085"], "ocr": ["ocr"],
                                     "pickscore": ["pickscore"]}[task]


def test_sd35m_dppo_recipes_follow_the_released_code():
    """Tencent-Hunyuan/UniRL@1a7b501 examples/diffusion/sd3_flowdppo.yaml: 512 px, flow_sde eta 0.7, 10 steps, CFG 1,
    3 random SDE steps among the first half (AllSDEScheduler num_sde_steps 3, timestep_fraction [0, 0.5]), own noise
    per sample, G 16 x 48 prompts, lr 3e-4, weight decay 0, grad clip 1, LoRA 32/64, no EMA, kl_mask_threshold 1e-5,
    no reference KL, batch-wide std, 2 optimizer steps per rollout over microbatches of 8 (on 8 processes), and its
    loss's step-0 std (flowdppo.py _compute_sigma_t); each recipe parses (test above) and names the source."""
    from trl_flow import FlowDPPOConfig

    for task in ("geneval", "ocr", "pickscore"):
        name = f"sd35m_dppo_{task}"
        r = _raw(name)
        assert r["trainer"] == "dppo" and r["model_name_or_path"] == "stabilityai/stable-diffusion-3.5-medium"
        assert (r["height"], r["width"], r["sampler"], r["noise_level"], r["num_inference_steps"]) == (
            512, 512, "flow_sde", 0.7, 10)
        assert (r["guidance_scale"], r["same_noise_per_group"]) == (1.0, False)
        assert (r["sde_steps_mode"], r["sde_window_size"], r["sde_window_range"]) == ("random", 3, 5)
        assert (r["num_generations"], r["prompts_per_step"]) == (16, 48)
        assert (float(r["learning_rate"]), float(r["weight_decay"]), r["max_grad_norm"]) == (3e-4, 0.0, 1.0)
        assert (r["lora_r"], r["lora_alpha"], r["ema_decay"]) == (32, 64, 0.0)
        assert "kl_mask_delta" not in r and FlowDPPOConfig().resolved_kl_mask_delta == 1e-5
        assert (float(r["beta"]), r["num_inner_epochs"], r["kl_mask_first_step"], r["scale_rewards"]) == (
            0.0, 1, "clamp", "batch")
        assert "clip_range" not in r
        # 768 samples on 8 processes: 12 microbatches of 8 each, in 2 optimizer steps
        per_process = r["num_generations"] * r["prompts_per_step"] // 8
        assert r["per_device_train_batch_size"] == 8 and per_process // 8 // r["gradient_accumulation_steps"] == 2
        with open(RECIPES[name]) as f:
            assert "Tencent-Hunyuan/UniRL@1a7b501" in f.read()
        assert r["reward_funcs"] == {"geneval": ["http://127.0.0.1:18085"], "ocr": ["ocr"],
                                     "pickscore": ["pickscore"]}[task]


def test_sd35m_diffusion_nft_recipes_carry_the_reference_settings():
    """NVlabs/DiffusionNFT@24af555 config/nft.py: 512 px, 10 CFG-free deterministic rollout steps, 40 eval steps, G 24,
    48 groups, microbatches of 9, lr 3e-4, LoRA 32/64, EMA 0.9, grad clip 1, train.beta 1e-4, fraction 0.99;
    nft_beta 1 / decay_type 1 / one optimizer step per iteration, except OCR: 0.1 / 2 / two steps."""
    for task in ("geneval", "ocr", "pickscore"):
        r = _raw(f"sd35m_diffusion_nft_{task}")
        assert r["trainer"] == "nft" and r["model_name_or_path"] == "stabilityai/stable-diffusion-3.5-medium"
        assert (r["height"], r["width"], r["num_inference_steps"], r["eval_num_inference_steps"]) == (512, 512, 10, 40)
        assert (r["sampler"], r["guidance_scale"], r["num_generations"], r["prompts_per_step"]) == ("ode", 1.0, 24, 48)
        assert (float(r["learning_rate"]), r["lora_r"], r["lora_alpha"], r["ema_decay"], r["max_grad_norm"]) == (
            3e-4, 32, 64, 0.9, 1.0)
        assert (float(r["beta"]), r["timestep_fraction"], r["adv_clip_max"], r["scale_rewards"]) == (
            1e-4, 0.99, 5.0, "batch")
        ocr = task == "ocr"
        assert (r["nft_beta"], r["decay_type"]) == ((0.1, 2) if ocr else (1.0, 1))
        # 1152 samples on 8 processes: 16 microbatches of 9 each, in 2 (OCR) or 1 optimizer step(s)
        assert r["per_device_train_batch_size"] == 9 and 16 // r["gradient_accumulation_steps"] == (2 if ocr else 1)
        assert r["reward_funcs"] == {"geneval": ["http://127.0.0.1:18085"], "ocr": ["ocr"],
                                     "pickscore": ["pickscore"]}[task]


SMOKE = ["--max_steps", "1", "--eval_steps", "0", "--prompts_per_step", "4", "--num_generations", "2",
         "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "1", "--disable_tqdm", "true"]


@pytest.mark.parametrize("name", CPU_RECIPES)
def test_cpu_recipe_trains_one_iteration(name, tmp_path):
    raw = _raw(name)
    command = raw["trainer"]
    trainer = cli.run(command, ["--config", name, "--output_dir", str(tmp_path), *SMOKE])
    assert trainer.state.global_step == 1
    entry = trainer.state.log_history[-1]
    assert 0.0 <= entry["reward"] <= 1.0
    if command != "nft":  # DiffusionNFT has no log-prob ratio
        assert entry["ratio_first_max_dev"] == 0.0
    assert os.path.exists(tmp_path / "pytorch_lora_weights.safetensors")
    # What was not overridden comes from the recipe.
    cfg = trainer.config
    assert (cfg.num_inference_steps, cfg.guidance_scale, cfg.lora_r) == (
        raw["num_inference_steps"], raw["guidance_scale"], raw["lora_r"])
    assert trainer.eval_dataset is not None and len(trainer.eval_dataset) > 0  # eval_dataset: shapes -> test split
