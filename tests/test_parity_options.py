"""The three reference-parity options of every trainer (Flow-GRPO reference code, ``scripts/train_sd3.py``):
the KL form, the gradient through classifier-free guidance, and the advantage std. Each is pinned against an
independent computation; the defaults are the reference code's."""

from __future__ import annotations

import math

import pytest
import torch

from trl_flow import FlowGRPOConfig
from trl_flow.kernels import gaussian_kl, kernel_mean_std, reference_kl


def test_defaults_are_the_reference_code():
    cfg = FlowGRPOConfig()
    assert (cfg.kl_form, cfg.guidance_grad, cfg.scale_rewards) == ("reference", "cond_only", "batch")


@pytest.mark.parametrize("field,value", [("kl_form", "approx"), ("guidance_grad", "uncond")])
def test_bad_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        FlowGRPOConfig(**{field: value})


@pytest.mark.parametrize("sigma,sigma_next", [(1.0, 0.9), (0.6, 0.45), (0.2, 0.1)])
def test_reference_kl_is_exact_kl_times_dt_for_flow_sde(sigma, sigma_next):
    g = torch.Generator().manual_seed(0)
    x, v, v_ref = (torch.randn(3, 4, 8, 8, generator=g) for _ in range(3))
    a = 0.7
    mu, std = kernel_mean_std("flow_sde", x, v, sigma, sigma_next, a)
    mu_ref, _ = kernel_mean_std("flow_sde", x, v_ref, sigma, sigma_next, a)
    # Independent: the reference code divides by 2 std_dev_t^2 with std_dev_t = a sqrt(s / (1 - s)) (s' at s = 1).
    s_den = sigma_next if sigma == 1 else sigma
    std_dev_t = a * math.sqrt(sigma / (1 - s_den))
    by_hand = ((mu - mu_ref) ** 2).mean(dim=(1, 2, 3)) / (2 * std_dev_t**2)
    ref = reference_kl("flow_sde", mu, mu_ref, std, torch.tensor(sigma), torch.tensor(sigma_next), "reference")
    torch.testing.assert_close(ref, by_hand, rtol=1e-5, atol=0)
    exact = gaussian_kl(mu, mu_ref, std)
    torch.testing.assert_close(ref, exact * (sigma - sigma_next), rtol=1e-5, atol=0)
    assert torch.equal(reference_kl("flow_sde", mu, mu_ref, std, sigma, sigma_next, "exact"), exact)


@pytest.mark.parametrize("sampler", ["cps", "ddim"])
def test_reference_kl_equals_exact_kl_for_cps_and_ddim(sampler):
    g = torch.Generator().manual_seed(1)
    x, v, v_ref = (torch.randn(2, 3, 4, 4, generator=g) for _ in range(3))
    mu, std = kernel_mean_std(sampler, x, v, 0.6, 0.4, 0.5)
    mu_ref, _ = kernel_mean_std(sampler, x, v_ref, 0.6, 0.4, 0.5)
    assert torch.equal(reference_kl(sampler, mu, mu_ref, std, 0.6, 0.4, "reference"), gaussian_kl(mu, mu_ref, std))


def test_trainer_kl_penalty_uses_the_configured_form(make_trainer):
    trainer = make_trainer(beta=0.04, kl_form="exact", guidance_scale=1.0, learning_rate=5e-2, max_steps=1)
    trainer.train()  # moves the LoRA away from the reference
    rollout = trainer.make_rollout(1)
    out = trainer.forward_step(rollout, torch.arange(4), 1, need_ref=True)
    exact = trainer.kl_penalty(rollout, 1, out).detach()
    trainer.config.kl_form = "reference"
    ref = trainer.kl_penalty(rollout, 1, out).detach()
    sig = rollout.schedule.sigmas
    assert float(exact.min()) > 0
    torch.testing.assert_close(exact, gaussian_kl(out.mean, out.ref_mean, out.std).detach())
    torch.testing.assert_close(ref, exact * float(sig[1] - sig[2]), rtol=1e-5, atol=0)


def _lora_grads(trainer, velocity_fn):
    model = trainer.model
    model.zero_grad(set_to_none=True)
    velocity_fn().pow(2).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("mode", ["cond_only", "both"])
def test_guidance_grad(make_trainer, mode):
    """cond_only: the gradient of the guided velocity equals that of ``u + w v_cond`` with the unconditional
    prediction ``u`` a constant; both: that of ``(1 - w) v_uncond + w v_cond``. Values are identical."""
    w = 4.5
    trainer = make_trainer(guidance_scale=w, guidance_grad=mode, learning_rate=5e-2, max_steps=1)
    trainer.train()  # non-zero LoRA B, so both branches depend on the LoRA weights
    rollout = trainer.make_rollout(1)
    idx, k = torch.arange(2), 1
    x, t = rollout.states[idx, k], rollout.schedule.timesteps[k]
    emb = {key: val[idx] for key, val in rollout.embeds.items()}
    cond = {"prompt_embeds": emb["prompt_embeds"], "pooled_prompt_embeds": emb["pooled_prompt_embeds"]}
    uncond = {"prompt_embeds": emb["negative_prompt_embeds"],
              "pooled_prompt_embeds": emb["negative_pooled_prompt_embeds"]}
    ad, model = trainer.adapter, trainer.model
    trainer.model.train()
    guided = _lora_grads(trainer, lambda: ad.velocity(model, x, t, emb, w, detach_uncond=mode == "cond_only"))
    with torch.no_grad():
        u_const = ad.velocity(model, x, t, uncond, 1.0)
    if mode == "cond_only":
        by_hand = _lora_grads(trainer, lambda: u_const + w * (ad.velocity(model, x, t, cond, 1.0) - u_const))
    else:
        by_hand = _lora_grads(trainer, lambda: (1 - w) * ad.velocity(model, x, t, uncond, 1.0)
                              + w * ad.velocity(model, x, t, cond, 1.0))
    assert guided.keys() == by_hand.keys() and guided
    for name in guided:
        # batched (CFG) vs separate forwards differ by float rounding, amplified by the (1 - w) cancellation
        torch.testing.assert_close(guided[name], by_hand[name], rtol=1e-3,
                                   atol=1e-3 * float(by_hand[name].abs().max()))
    # The forward value (hence every log-prob and ratio) does not depend on the option.
    out = trainer.forward_step(rollout, idx, k, need_ref=False)
    assert torch.equal(out.log_prob.detach(), rollout.log_probs[idx, k])


def test_guidance_grad_changes_the_gradient(make_trainer, tmp_path):
    """The two modes differ (so the option is not a no-op)."""
    grads = {}
    for mode in ("cond_only", "both"):
        trainer = make_trainer(guidance_scale=4.5, guidance_grad=mode, learning_rate=5e-2, max_steps=1,
                               output_dir=str(tmp_path / mode))  # a new run needs a folder of its own
        trainer.train()
        rollout = trainer.make_rollout(1)
        trainer.model.train()
        grads[mode] = _lora_grads(trainer, lambda: trainer.forward_step(rollout, torch.arange(2), 1, False).log_prob)
    name = next(iter(grads["both"]))
    assert not torch.allclose(grads["both"][name], grads["cond_only"][name])
