"""Flow-DPPO: Flow-GRPO with a divergence trust region (a KL mask) instead of the ratio clip."""

from __future__ import annotations

from .flow_dppo_config import FlowDPPOConfig
from .flow_grpo_trainer import FlowGRPOTrainer


class FlowDPPOTrainer(FlowGRPOTrainer):
    """Flow-DPPO, from "Flow-DPPO: Divergence Proximal Policy Optimization for Flow Matching Models"
    (arXiv 2606.11025).

    ```python
    from trl_flow import FlowDPPOConfig, FlowDPPOTrainer
    from trl_flow.rewards import jpeg_incompressibility
    from trl_flow.testing import tiny_sd3_pipeline

    # or StableDiffusion3Pipeline.from_pretrained("stabilityai/stable-diffusion-3.5-medium")
    pipe = tiny_sd3_pipeline()
    config = FlowDPPOConfig(output_dir="out", max_steps=2, num_generations=4, prompts_per_step=2, sampler="cps",
                            height=32, width=32, num_inference_steps=4, per_device_train_batch_size=4,
                            max_sequence_length=16)
    trainer = FlowDPPOTrainer(config, pipe, [jpeg_incompressibility], train_dataset=["a cat", "a dog"])
    trainer.train()
    trainer.save_model("out/final")  # pipe.load_lora_weights("out/final")
    ```

    Rollout, rewards and group advantages ``A`` (N,) are Flow-GRPO's. Per trained step ``k`` of a microbatch of B
    samples, with ``logp_old`` (B,) and ``mu_old`` (B, *L) frozen from the rollout before the inner epochs:

    - ``D = ||mu_old - mu_theta||^2 / (2 std^2)`` (B,), mean-reduced over the latent dims, ``std`` the kernel's full
      std (``flow_sde``: including ``sqrt(-dt)``);
    - ``M = 0`` iff ``D > kl_mask_delta`` and ``(A > 0 and rho > 1) or (A < 0 and rho < 1)``, detached: an update
      back toward the old policy is never blocked;
    - loss ``-mean(M rho A) + beta KL(pi_theta || pi_ref)``, no clip; the ``beta`` term is the shared penalty to the
      reference policy in ``kl_form`` (a different quantity from ``D``).

    Defaults, from the authors' released code (UniRL, ``examples/diffusion/sd3_flowdppo.yaml``) where it and the
    paper differ: one pass over each rollout (``num_inner_epochs=1``; the code's ``num_updates_per_batch: 2`` is two
    optimizer steps over disjoint halves, each sample once, as in its Flow-GRPO recipe; two passes are the option
    ``num_inner_epochs=2``), ``beta=0`` (the released loss has no reference term; the paper's ablation, 1e-3 on the
    exact kernel KL, is the option ``beta=1e-3``), ``kl_mask_delta=1e-5`` for every kernel.
    ``kl_mask_mode="symmetric"`` is an ablation. The same trust region is available to every trainer through
    ``trust_region="kl_mask"`` (e.g. ``OPGRPOConfig(trust_region="kl_mask")``); the math is in
    :mod:`trl_flow.trust_region`. Logged: ``mask_frac`` (and ``_pos_adv`` / ``_neg_adv``), ``kl_old`` (mean),
    ``kl_old_max``, ``kl_old_first_max`` (0: nothing has moved before the first update), ``ratio`` /
    ``ratio_max`` / ``ratio_min`` / ``ratio_first_max_dev``.
    """

    config_class = FlowDPPOConfig
    _method_name = "flow_dppo"
    summary = "Flow-DPPO: KL trust region instead of ratio clipping (arXiv 2606.11025)"
    paper = "Flow-DPPO, arXiv 2606.11025"
