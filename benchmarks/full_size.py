"""Full-size families on one GPU, random weights, no download: step times, overhead ratios and peak memory.

For each family, the real transformer and VAE are built from the real models' config.json values (written below,
with their Hub ids) with random weights, in bf16 on the GPU. The text encoders are not built at full size (the tiny
pipeline's stand in, never called): the adapter's ``encode_prompts`` is replaced by random embeddings of the real
shapes (keys, ranks and dtypes taken from what the family's adapter returns on its tiny pipeline in
``trl_flow.testing``; sequence length and width from the real text encoder), which the pipeline takes as
``prompt_embeds``. Families whose prompts are masked (Qwen-Image, Z-Image) get all ``max_sequence_length`` tokens
valid: an upper bound on the text stream's cost. Then, at the published resolution, frames and batch (the family's
recipe in ``trl_flow/recipes/`` where there is one, else the setting given here, marked ``fallback``):

* ``rollout``: ``FlowGRPOTrainer.sample`` (SDE rollout storing states, means, log-probs) vs ``pipe(prompt_embeds=...,
  output_type="latent")`` with the same embeddings, steps, batch and guidance, interleaved (``overhead.py``'s
  ``_median_times``); per-step times and the ratio;
* ``decode``: the adapter's decode of the rollout's final latents (the VAE at full size);
* ``update``: ``FlowGRPOTrainer.optimize`` on that rollout vs the bare transformer forward + backward of the same
  calls (recorded with ``overhead.py``'s ``record_transformer_calls``), plus the no-grad reference forward when the
  recipe's ``beta`` > 0;
* peak GPU memory of each (``torch.cuda.max_memory_allocated``) and of the weights alone;
* ``iterations``: on the same trainer, ``--repeats`` whole ``training_iteration`` calls per setting of
  :data:`SETTINGS` (``baseline``: the recipe, every non-final step stochastic and trained; ``fast``:
  ``sde_window_size=2``, ``shared_prefix`` with ``same_noise_per_group``, ``batch_replay_steps``,
  ``trajectory_storage="trained"``), each with the trainer's own ``throughput/{rollout,update,iteration}_images_per_s``
  (images per GPU-second, verl-omni's unit), ``calls/*``, ``rows/*``, ``throughput/tflops`` and, where the GPU's
  peak is known (``trl_flow/engine/throughput.py``), ``throughput/mfu``; and its peak memory.

``--table [JSON]`` prints a markdown table of a full_size JSON (family, setting, resolution x frames x batch, steps,
images/s per phase, peak GiB, MFU; "not run on a GPU yet" rows for a dry-run or ``--tiny`` JSON); with ``--page
docs/performance.md`` it also replaces the page's block between :data:`TABLE_START` and :data:`TABLE_END`
(:func:`write_table`).

Sampling steps are capped per family (``bench_steps``, or ``--steps``) so that every family fits its time budget: the
per-step times do not depend on the number of steps, and the JSON records both the published and the run count.
Each family runs in its own process with a time budget (killed past it, ``status: "timeout"`` with whatever stages
finished); an out-of-memory stage is recorded as ``status: "oom"``; a family whose adapter or tiny pipeline cannot be
imported in this version is ``status: "skipped"`` with the reason. The whole run stays under ``--time-limit``
(default 450 s, under 8 minutes with start-up).

    python benchmarks/full_size.py   # every family, GPU; writes benchmarks/results/full_size.json
    python benchmarks/full_size.py --families flux.1-dev wan2.1-t2v-1.3b --out /tmp/fs.json
    python benchmarks/full_size.py --tiny --out /tmp/tiny.json   # CPU, tiny configs, seconds (the tests run this)
    python benchmarks/full_size.py --dry-run     # no GPU: build the real configs on the meta device, print sizes
    python benchmarks/full_size.py --table benchmarks/results/full_size.json --page docs/performance.md
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import glob
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from overhead import _median_times, record_transformer_calls  # noqa: E402  (the shared measurement helpers)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = os.path.join(ROOT, "trl_flow", "recipes")

# The real VAEs (config.json of each model's vae/ folder).
_SD_VAE = dict(in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 4,
               up_block_types=["UpDecoderBlock2D"] * 4, block_out_channels=[128, 256, 512, 512], layers_per_block=2,
               latent_channels=16, norm_num_groups=32, sample_size=1024, use_quant_conv=False,
               use_post_quant_conv=False)
SD35_VAE = dict(_SD_VAE, scaling_factor=1.5305, shift_factor=0.0609)
FLUX1_VAE = dict(_SD_VAE, scaling_factor=0.3611, shift_factor=0.1159)  # FLUX.1 and Z-Image
WAN21_VAE = dict(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                 temperal_downsample=[False, True, True])
FLUX2_VAE = dict(latent_channels=32, block_out_channels=[128, 256, 512, 512], layers_per_block=2, patch_size=[2, 2])
QWEN_VAE = dict(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                temperal_downsample=[False, True, True])
_WAN_UNIPC = dict(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0, num_train_timesteps=1000)
_FLUX2_TRANSFORMER = dict(patch_size=1, in_channels=128, out_channels=None, attention_head_dim=128,
                          timestep_guidance_channels=256, mlp_ratio=3.0, axes_dims_rope=[32, 32, 32, 32],
                          rope_theta=2000, eps=1e-6)
_WAN_TRANSFORMER = dict(patch_size=[1, 2, 2], attention_head_dim=128, in_channels=16, out_channels=16, text_dim=4096,
                        freq_dim=256, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6,
                        rope_max_seq_len=1024)


@dataclass
class Spec:
    """One family at full size. ``text`` gives the real text embeddings: ``seq`` tokens (None: the setting's
    ``max_sequence_length``) of ``width`` channels, pooled vectors of ``pooled`` channels."""

    hub_id: str
    pipeline: str  # the diffusers pipeline class (its registry key)
    tiny_builder: str  # trl_flow.testing builder of the same form, for the embedding keys and the --tiny run
    transformer: tuple[str, dict]
    vae: tuple[str, dict]
    scheduler: tuple[str, dict]
    text: dict
    setting: dict  # fallback published setting (a recipe overrides it)
    bench_steps: int  # sampling steps run on the GPU (<= the setting's)
    budget_s: int  # seconds for this family's process on the GPU
    pipeline_config: dict = field(default_factory=dict)  # non-module pipeline arguments (boundary_ratio, ...)
    extra_transformers: tuple[str, ...] = ()  # further experts built like `transformer` (Wan2.2's transformer_2)
    tiny_kwargs: dict = field(default_factory=dict)
    pipe_kwargs: dict = field(default_factory=dict)  # extra pipe() arguments; "{guidance}" is the guidance scale
    source: str = ""  # where the configs and the fallback setting come from


SPECS: dict[str, Spec] = {
    "sd3.5-medium": Spec(
        hub_id="stabilityai/stable-diffusion-3.5-medium", pipeline="StableDiffusion3Pipeline",
        tiny_builder="tiny_sd3_pipeline",
        transformer=("SD3Transformer2DModel", dict(
            sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=24, attention_head_dim=64,
            num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536, pooled_projection_dim=2048,
            pos_embed_max_size=384, dual_attention_layers=list(range(13)), qk_norm="rms_norm")),
        vae=("AutoencoderKL", SD35_VAE),
        scheduler=("FlowMatchEulerDiscreteScheduler", dict(num_train_timesteps=1000, shift=3.0)),
        text=dict(seq=77 + 256, width=4096, pooled=2048),  # CLIP-L/G (77) + T5 (256); pooled CLIP-L + CLIP-G
        setting=dict(height=512, width=512, num_inference_steps=10, guidance_scale=4.5, per_device_train_batch_size=8,
                     max_sequence_length=256, beta=0.01, lora_r=32, lora_alpha=64),
        bench_steps=6, budget_s=70, source="Flow-GRPO's SD3.5-M settings (recipe sd35m_flow_grpo_pickscore)"),
    "flux.1-dev": Spec(
        hub_id="black-forest-labs/FLUX.1-dev", pipeline="FluxPipeline", tiny_builder="tiny_flux_pipeline",
        transformer=("FluxTransformer2DModel", dict(
            patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
            num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
            axes_dims_rope=[16, 56, 56])),
        vae=("AutoencoderKL", FLUX1_VAE),
        scheduler=("FlowMatchEulerDiscreteScheduler", dict(
            num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
            base_image_seq_len=256, max_image_seq_len=4096)),
        text=dict(seq=None, width=4096, pooled=768),  # T5-XXL tokens, CLIP-L pooled
        setting=dict(height=512, width=512, num_inference_steps=6, guidance_scale=3.5, per_device_train_batch_size=3,
                     max_sequence_length=128, beta=0.0, lora_r=64, lora_alpha=128),
        bench_steps=6, budget_s=70, source="Flow-GRPO's FLUX.1-dev settings (recipe flux1_dev_flow_grpo)"),
    "wan2.1-t2v-1.3b": Spec(
        hub_id="Wan-AI/Wan2.1-T2V-1.3B-Diffusers", pipeline="WanPipeline", tiny_builder="tiny_wan_pipeline",
        transformer=("WanTransformer3DModel", dict(_WAN_TRANSFORMER, num_attention_heads=12, ffn_dim=8960,
                                                   num_layers=30)),
        vae=("AutoencoderKLWan", WAN21_VAE),
        scheduler=("UniPCMultistepScheduler", _WAN_UNIPC),
        text=dict(seq=None, width=4096),  # UMT5-XXL
        setting=dict(height=240, width=416, num_frames=33, num_inference_steps=20, guidance_scale=4.5,
                     per_device_train_batch_size=8, max_sequence_length=512, beta=0.004, lora_r=32, lora_alpha=64,
                     gradient_checkpointing=True),
        bench_steps=6, budget_s=85, source="Flow-GRPO's Wan2.1 settings (recipe wan21_t2v_1.3b_flow_grpo)"),
    "z-image": Spec(
        hub_id="Tongyi-MAI/Z-Image-Turbo", pipeline="ZImagePipeline", tiny_builder="tiny_zimage_pipeline",
        transformer=("ZImageTransformer2DModel", dict(
            all_patch_size=[2], all_f_patch_size=[1], in_channels=16, dim=3840, n_layers=30, n_refiner_layers=2,
            n_heads=30, n_kv_heads=30, norm_eps=1e-5, qk_norm=True, cap_feat_dim=2560, rope_theta=256.0,
            t_scale=1000.0, axes_dims=[32, 48, 48], axes_lens=[1536, 512, 512])),
        vae=("AutoencoderKL", FLUX1_VAE),
        scheduler=("FlowMatchEulerDiscreteScheduler", dict(num_train_timesteps=1000, shift=3.0)),
        text=dict(seq=None, width=2560),  # Qwen3-4B hidden states
        setting=dict(height=512, width=512, num_inference_steps=6, guidance_scale=0.0, per_device_train_batch_size=4,
                     max_sequence_length=512, beta=0.0, lora_r=64, lora_alpha=128),
        bench_steps=6, budget_s=65,
        source="configs: Tongyi-MAI/Z-Image-Turbo transformer/ and scheduler/ config.json (shift 3; the base "
               "Z-Image: 6)"),
    "flux.2-klein-base-9b": Spec(
        hub_id="black-forest-labs/FLUX.2-klein-base-9B", pipeline="Flux2KleinPipeline",
        tiny_builder="tiny_flux2_klein_pipeline",
        transformer=("Flux2Transformer2DModel", dict(_FLUX2_TRANSFORMER, num_layers=8, num_single_layers=24,
                                                     num_attention_heads=32, joint_attention_dim=12288,
                                                     guidance_embeds=False)),
        vae=("AutoencoderKLFlux2", FLUX2_VAE),
        scheduler=("FlowMatchEulerDiscreteScheduler", dict(
            num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
            base_image_seq_len=256, max_image_seq_len=4096, time_shift_type="exponential")),
        text=dict(seq=None, width=12288),  # Qwen3-8B: 3 hidden layers of 4096 stacked
        setting=dict(height=384, width=384, num_inference_steps=8, guidance_scale=4.0, per_device_train_batch_size=1,
                     max_sequence_length=512, beta=0.0, lora_r=64, lora_alpha=128),
        bench_steps=4, budget_s=60, pipeline_config={"is_distilled": False},
        source="configs: FLUX.2-klein-base-9B transformer/config.json (8 + 24 blocks, 32 heads, text 12288; the 4B: "
               "5 + 20, 24, 7680)"),
    "qwen-image": Spec(
        hub_id="Qwen/Qwen-Image", pipeline="QwenImagePipeline", tiny_builder="tiny_qwen_image_pipeline",
        transformer=("QwenImageTransformer2DModel", dict(
            patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
            num_attention_heads=24, joint_attention_dim=3584, guidance_embeds=False, axes_dims_rope=[16, 56, 56])),
        vae=("AutoencoderKLQwenImage", QWEN_VAE),
        scheduler=("FlowMatchEulerDiscreteScheduler", dict(
            num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
            base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential")),
        text=dict(seq=None, width=3584),  # Qwen2.5-VL-7B hidden states
        setting=dict(height=512, width=512, num_inference_steps=10, guidance_scale=4.0, per_device_train_batch_size=4,
                     max_sequence_length=512, beta=0.0, lora_r=64, lora_alpha=128, gradient_checkpointing=True),
        bench_steps=4, budget_s=85, pipe_kwargs={"true_cfg_scale": "{guidance}", "guidance_scale": None},
        source="configs: Qwen/Qwen-Image transformer/ and scheduler/ config.json"),
    "flux.2-dev": Spec(
        hub_id="black-forest-labs/FLUX.2-dev", pipeline="Flux2Pipeline", tiny_builder="tiny_flux2_pipeline",
        transformer=("Flux2Transformer2DModel", dict(_FLUX2_TRANSFORMER, num_layers=8, num_single_layers=48,
                                                     num_attention_heads=48, joint_attention_dim=15360,
                                                     guidance_embeds=True)),
        vae=("AutoencoderKLFlux2", FLUX2_VAE),
        scheduler=("FlowMatchEulerDiscreteScheduler", dict(
            num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
            base_image_seq_len=256, max_image_seq_len=4096, time_shift_type="exponential")),
        text=dict(seq=None, width=15360),  # Mistral-Small-3.1: 3 hidden layers of 5120 stacked
        setting=dict(height=512, width=512, num_inference_steps=8, guidance_scale=4.0, per_device_train_batch_size=1,
                     max_sequence_length=512, beta=0.0, lora_r=64, lora_alpha=128, gradient_checkpointing=True),
        bench_steps=4, budget_s=95,
        source="configs: black-forest-labs/FLUX.2-dev transformer/config.json (= diffusers' defaults)"),
    "wan2.2-t2v-a14b": Spec(
        hub_id="Wan-AI/Wan2.2-T2V-A14B-Diffusers", pipeline="WanPipeline", tiny_builder="tiny_wan22_pipeline",
        transformer=("WanTransformer3DModel", dict(_WAN_TRANSFORMER, num_attention_heads=40, ffn_dim=13824,
                                                   num_layers=40)),
        extra_transformers=("transformer_2",),
        vae=("AutoencoderKLWan", WAN21_VAE),
        scheduler=("UniPCMultistepScheduler", _WAN_UNIPC),
        text=dict(seq=None, width=4096),
        setting=dict(height=480, width=480, num_frames=5, num_inference_steps=10, guidance_scale=4.0,
                     guidance_scale_2=3.0, per_device_train_batch_size=1, max_sequence_length=512, beta=0.0, lora_r=64,
                     lora_alpha=128, gradient_checkpointing=True, experts="all"),
        bench_steps=4, budget_s=100, pipeline_config={"boundary_ratio": 0.875},
        source="configs: Wan2.2-T2V-A14B-Diffusers (two 14B experts, boundary_ratio 0.875); setting: Flow-Factory's "
               "Wan2.2 GRPO example (recipe wan22_t2v_a14b_flow_grpo)"),
}
# SD3.5-M and Qwen-Image first: the families the peers report (verl-omni: SD3.5-M and Qwen-Image LoRA), so they are
# measured before --time-limit can cut the run short.
FIRST_FAMILIES = ("sd3.5-medium", "qwen-image")
SPECS = {**{k: SPECS[k] for k in FIRST_FAMILIES}, **{k: v for k, v in SPECS.items() if k not in FIRST_FAMILIES}}

#: The training iterations measured per family (``throughput/*_images_per_s``, ``rows/*``, ``calls/*``, MFU and
#: peak memory), each at the recipe's setting: ``baseline`` as the recipe runs (every non-final step stochastic and
#: trained); ``fast`` with the speed techniques on (the trainer's defaults for every other field).
SETTINGS: dict[str, dict] = {
    "baseline": {},
    "fast": dict(sde_window_size=2, shared_prefix=True, same_noise_per_group=True, batch_replay_steps=True,
                 trajectory_storage="trained"),
}
ITERATIONS_NOTE = (
    "Per family, after the overhead stages (kernels warm) and on the same trainer: --repeats training_iteration calls "
    "per setting (medians), baseline first, at the family's steps_run (bench_steps, not the published count: images/s "
    "at the published count are lower, the rollout's by about steps_run / steps_published); fast at the same steps "
    "and repeats as baseline (no reduction); its window start is drawn per iteration, so its ODE prefix (shared) "
    "varies between 0 and steps_run // 2 - 1 steps. images_per_s = samples / seconds on one GPU (images per "
    "GPU-second); rollout includes prompt encoding (random embeddings), decode and reward; MFU: the trainer's "
    "throughput/mfu (dense bf16 peak by GPU name; none on the CPU or an unknown GPU).")
#: The trainer metrics each setting records (``training_iteration``'s names, engine/throughput.py).
ITERATION_METRICS = ("throughput/rollout_images_per_s", "throughput/update_images_per_s",
                     "throughput/iteration_images_per_s", "time/rollout_s", "time/update_s", "time/reward_s",
                     "calls/rollout_transformer", "calls/update_transformer", "rows/rollout_transformer",
                     "rows/update_transformer", "calls/text_encoder", "throughput/tflop", "throughput/tflops",
                     "throughput/mfu")

TINY_SETTING = dict(height=32, width=32, num_frames=5, num_inference_steps=4, per_device_train_batch_size=2,
                    max_sequence_length=16, lora_r=4, lora_alpha=8, gradient_checkpointing=False)
SETTING_KEYS = ("height", "width", "num_frames", "num_inference_steps", "guidance_scale",
                "per_device_train_batch_size",
                "max_sequence_length", "beta", "lora_r", "lora_alpha", "lora_target_modules", "gradient_checkpointing",
                "noise_level", "experts", "guidance_scale_2")
FAMILY_FIELDS = ("experts", "guidance_scale_2")  # config fields of some families, passed when the setting has them


# ----------------------------------------------------------------------------------------------- set-up
def availability(name: str) -> str | None:
    """None when the family can run in this version, else why not."""
    import diffusers

    import trl_flow.models as models
    import trl_flow.testing as testing

    spec = SPECS[name]
    if not hasattr(diffusers, spec.pipeline):
        return f"diffusers {diffusers.__version__} has no {spec.pipeline}"
    if spec.pipeline not in models.registered_adapters():
        return f"no adapter registered for {spec.pipeline}"
    try:
        models._resolve(spec.pipeline)
    except Exception as e:  # a lazy built-in entry whose module is not there yet
        return f"adapter for {spec.pipeline} not importable: {type(e).__name__}: {e}"
    try:
        getattr(testing, spec.tiny_builder)
    except Exception as e:
        return f"trl_flow.testing.{spec.tiny_builder} not importable: {type(e).__name__}: {e}"
    for cls in (spec.transformer[0], spec.vae[0], spec.scheduler[0]):
        if not hasattr(diffusers, cls):
            return f"diffusers {diffusers.__version__} has no {cls}"
    return None


def published_setting(spec: Spec) -> tuple[dict, str]:
    """The family's setting: its recipe's values (the first recipe naming its Hub id, Flow-GRPO's preferred) over
    the fallback here."""
    import yaml

    setting = dict(spec.setting)
    paths = sorted(glob.glob(os.path.join(RECIPES, "*.yaml")), key=lambda p: ("flow_grpo" not in p, p))
    for path in paths:
        with open(path, encoding="utf-8") as f:
            recipe = yaml.safe_load(f) or {}
        if recipe.get("model_name_or_path") == spec.hub_id:
            setting.update({k: recipe[k] for k in SETTING_KEYS if k in recipe})
            return setting, f"recipe {os.path.relpath(path, ROOT)}"
    return setting, "fallback (no recipe for this Hub id)"


@contextlib.contextmanager
def build_on(device: torch.device, dtype: torch.dtype):
    """Modules created inside get their weights on ``device`` in ``dtype`` directly (random init on the GPU: a
    32B transformer never exists in float32 or on the CPU)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(old)


def build_pipeline(name: str, tiny: bool, device: torch.device, dtype: torch.dtype):
    """The family's pipeline with random full-size (or, ``tiny``, the tiny builder's)
    transformer(s), VAE and scheduler; and the tiny pipeline (for the embedding template)."""
    import diffusers

    import trl_flow.testing as testing

    spec = SPECS[name]
    small = getattr(testing, spec.tiny_builder)(**spec.tiny_kwargs)
    comps, cfgs = {}, {}
    for key in ("transformer", *spec.extra_transformers):
        comps[key] = type(getattr(small, key)) if tiny else getattr(diffusers, spec.transformer[0])
        cfgs[key] = dict(getattr(small, key).config) if tiny else spec.transformer[1]
    comps["vae"] = type(small.vae) if tiny else getattr(diffusers, spec.vae[0])
    cfgs["vae"] = dict(small.vae.config) if tiny else spec.vae[1]
    sched_cls = type(small.scheduler) if tiny else getattr(diffusers, spec.scheduler[0])
    scheduler = sched_cls.from_config(dict(small.scheduler.config) if tiny else spec.scheduler[1])
    torch.manual_seed(0)
    with build_on(device, dtype):
        modules = {k: cls.from_config(cfgs[k]) for k, cls in comps.items()}
    for m in modules.values():
        m.requires_grad_(False).eval()
    # The text encoders and tokenizers are the tiny pipeline's: never called (encode_prompts is replaced), kept so
    # that code reading their configs (an adapter's constructor, the long-prompt check) works.
    kwargs = dict(small.components)
    kwargs.update(modules, scheduler=scheduler)
    for key in small.config:
        if not key.startswith("_") and key not in kwargs:  # boundary_ratio, expand_timesteps, is_distilled
            kwargs[key] = small.config[key] if tiny else spec.pipeline_config.get(key, small.config[key])
    pipe = getattr(diffusers, spec.pipeline)(**kwargs)
    pipe.set_progress_bar_config(disable=True)
    return pipe, small


def embed_template(adapter, guidance: bool, max_seq: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    with torch.no_grad():
        embeds = adapter.encode_prompts(["a cat", "a red dog"], guidance, max_seq)
    return {k: (tuple(v.shape[1:]), v.dtype) for k, v in embeds.items()}


def full_shapes(template, text: dict, max_seq: int, tiny: bool) -> dict:
    """Per-sample shapes of the real embeddings: (seq, width) sequences, (seq,) masks, (pooled,) vectors."""
    if tiny:
        return template
    seq = text.get("seq") or max_seq
    out = {}
    for key, (shape, dtype) in template.items():
        if dtype.is_floating_point and len(shape) == 2:
            out[key] = ((seq, text["width"]), None)
        elif dtype.is_floating_point and len(shape) == 1 and text.get("pooled"):
            out[key] = ((text["pooled"],), None)
        elif not dtype.is_floating_point and len(shape) == 1:
            out[key] = ((seq,), dtype)
        else:
            raise ValueError(f"embedding {key!r} of per-sample shape {shape} ({dtype}): no rule to scale it to full "
                             "size; add one to benchmarks/full_size.py:full_shapes")
    return out


def random_encoder(shapes: dict, device, dtype):
    """``encode_prompts`` replacement: random embeddings (ones for masks) of the real shapes."""
    def encode_prompts(prompts, guidance, max_sequence_length):
        gen = torch.Generator(device=device).manual_seed(len(prompts))
        out = {}
        for key, (shape, mask_dtype) in shapes.items():
            if key.startswith("negative_") and not guidance:
                continue
            if mask_dtype is not None and not mask_dtype.is_floating_point:
                out[key] = torch.ones((len(prompts), *shape), dtype=mask_dtype, device=device)
            else:
                out[key] = torch.randn((len(prompts), *shape), generator=gen, device=device, dtype=dtype)
        return out
    return encode_prompts


# ----------------------------------------------------------------------------------------------- measuring
class Tracker:
    """Peak memory per stage: CUDA's max allocated (reset at each call), or the process's peak RSS on the CPU."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.peaks: dict[str, float] = {}

    def wrap(self, name, fn):
        def run():
            if self.cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            fn()
            if self.cuda:
                torch.cuda.synchronize()
                self.peaks[name] = max(self.peaks.get(name, 0.0), torch.cuda.max_memory_allocated() / 2**30)
        return run

    def allocated_gib(self) -> float | None:
        return round(torch.cuda.memory_allocated() / 2**30, 3) if self.cuda else None


def _free_memory(device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_iteration(trainer, config, label: str, fields: dict, tracker: Tracker, device, step: int,
                  repeats: int) -> dict:
    """``repeats`` calls of ``trainer.training_iteration`` with ``fields`` over the recipe's ``config`` (the trainer
    reads these fields at call time, so one trainer, its LoRA and optimizer serve every setting): the trainer's own
    throughput metrics (medians), its transformer calls and rows, trained steps and the peak memory. An
    out-of-memory or failing setting is recorded (``status``) without stopping the next one."""
    out = {"config": dict(fields), "repeats": repeats, "status": "running"}
    try:
        trainer.config = dataclasses.replace(config, **fields)
        trainer._check_batch_replay_steps()
        runs = []
        for r in range(repeats):
            got = {}
            tracker.wrap(f"iteration:{label}", lambda s=step + r: got.update(trainer.training_iteration(s)))()
            got["trained_steps"] = len(trainer.last_rollout.trained_steps())
            out["trained_step_indices"] = [int(k) for k in trainer.last_rollout.trained_steps()]  # (the last run's)
            got["samples"] = len(trainer.last_rollout)
            trainer.last_rollout = None
            runs.append(got)
        for key in (*ITERATION_METRICS, "trained_steps", "samples"):
            values = sorted(float(r[key]) for r in runs if key in r)
            if values:
                out[key.split("/", 1)[-1] if key.startswith("throughput/") else key] = values[len(values) // 2]
        out["peak_gib"] = tracker.peaks.get(f"iteration:{label}")
        out["status"] = "ok"
    except torch.OutOfMemoryError as e:
        out["status"], out["error"] = "oom", str(e).splitlines()[0]
    except Exception as e:  # recorded; the next setting still runs
        out["status"], out["error"] = "error", f"{type(e).__name__}: {e}"
    finally:
        trainer.config = config
        trainer.last_rollout = None
        _free_memory(device)
    return out


def measure(name: str, tiny: bool, steps: int | None, repeats: int, partial: str | None,
            settings: tuple[str, ...] = tuple(SETTINGS)) -> dict:
    """Run one family in this process; ``partial``: a JSON file rewritten after each stage; ``settings``: the
    training iterations to measure (names in :data:`SETTINGS`)."""
    from trl_flow import FlowGRPOConfig, FlowGRPOTrainer
    from trl_flow.models import get_adapter

    spec = SPECS[name]
    device = torch.device("cuda" if torch.cuda.is_available() and not tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    setting, source = published_setting(spec)
    if tiny:
        setting.update(TINY_SETTING)
        source += " (tiny: sizes replaced)"
    K_pub = setting["num_inference_steps"]
    K = min(K_pub, steps or (K_pub if tiny else spec.bench_steps))
    res = {"family": name, "hub_id": spec.hub_id, "pipeline": spec.pipeline, "status": "running", "stage": "build",
           "setting": setting, "setting_source": source, "config_source": spec.source, "steps_published": K_pub,
           "steps_run": K, "device": str(device), "dtype": str(dtype).replace("torch.", "")}

    def save():
        if partial:
            with open(partial + ".tmp", "w") as f:
                json.dump(res, f, indent=1)
            os.replace(partial + ".tmp", partial)

    save()
    tracker = Tracker(device)
    try:
        t0 = time.perf_counter()
        pipe, small = build_pipeline(name, tiny, device, dtype)
        adapter = get_adapter(pipe)
        g = setting["guidance_scale"]
        template = embed_template(get_adapter(small), g > 1, TINY_SETTING["max_sequence_length"])
        shapes = full_shapes(template, spec.text, setting["max_sequence_length"], tiny)
        adapter.encode_prompts = random_encoder(shapes, device, dtype)
        res["embeddings"] = {k: list(s) for k, (s, _) in shapes.items()}
        res["transformer_params_b"] = round(sum(p.numel() for k in ("transformer", *spec.extra_transformers)
                                                for p in getattr(pipe, k).parameters()) / 1e9, 4)
        res["build_s"] = time.perf_counter() - t0
        res["weights_gib"] = tracker.allocated_gib()
        N = setting["per_device_train_batch_size"]
        n = max(2, N)  # a group of at least 2 (one prompt); sampled and trained in chunks of N
        with tempfile.TemporaryDirectory() as out:
            config = FlowGRPOConfig(
                output_dir=out, max_steps=1, num_generations=n, prompts_per_step=1, per_device_train_batch_size=N,
                height=setting["height"], width=setting["width"], num_frames=setting.get("num_frames", 33),
                max_sequence_length=setting["max_sequence_length"], num_inference_steps=K, guidance_scale=g,
                noise_level=setting.get("noise_level", 0.7), beta=setting.get("beta", 0.0),
                lora_r=setting.get("lora_r", 32), lora_alpha=setting.get("lora_alpha", 64),
                lora_target_modules=setting.get("lora_target_modules"),
                gradient_checkpointing=setting.get("gradient_checkpointing", False), bf16=dtype == torch.bfloat16,
                guidance_grad="both", disable_tqdm=True, **{k: setting[k] for k in FAMILY_FIELDS if k in setting})

            def reward(images, prompts, **columns):
                return images.float().mean(dim=tuple(range(1, images.ndim)))

            trainer = FlowGRPOTrainer(config, adapter, [reward], train_dataset=["a photo of a cat"])
            res["weights_and_lora_gib"] = tracker.allocated_gib()
            res["latent_shape"] = list(adapter.latent_shape(setting["height"], setting["width"]))
            res["rollout_mb_per_sample"] = round(adapter.rollout_bytes(1, K, setting["height"], setting["width"])
                                                 / 1e6, 3)
            res["rollout_mb_per_sample_published_steps"] = round(
                adapter.rollout_bytes(1, K_pub, setting["height"], setting["width"]) / 1e6, 3)
            save()

            # ---------------------------------------------------------------------------- rollout vs pipe()
            res["stage"] = "rollout"
            prompts, columns, group_ids = trainer.sample_prompts(0)
            embeds = adapter.encode_prompts(prompts, g > 1, setting["max_sequence_length"])
            pipe_embeds = adapter.pipeline_embeds(embeds) if hasattr(adapter, "pipeline_embeds") else embeds
            call = dict(height=setting["height"], width=setting["width"], num_inference_steps=K, guidance_scale=g,
                        output_type="latent")
            if "num_frames" in setting and spec.pipeline == "WanPipeline":
                call["num_frames"] = setting["num_frames"]
            if "guidance_scale_2" in setting:  # Wan2.2's low-noise expert
                call["guidance_scale_2"] = setting["guidance_scale_2"]
            for k, v in spec.pipe_kwargs.items():
                if v is None:
                    call.pop(k, None)
                else:
                    call[k] = g if v == "{guidance}" else v
            held = {}

            @torch.no_grad()
            def pipe_call():
                for lo in range(0, n, N):  # the trainer's sampling chunks
                    chunk = {k: v[lo:lo + N] for k, v in pipe_embeds.items()}
                    pipe(**chunk, generator=torch.Generator(device).manual_seed(0), **call)

            def trl_sample():
                held["rollout"] = trainer.sample(prompts, columns, group_ids, 0)

            with torch.no_grad():  # warm-up: one guided velocity of a chunk (kernels, allocator)
                x = adapter.initial_noise(N, setting["height"], setting["width"], torch.Generator().manual_seed(0))
                with trainer._autocast():
                    adapter.velocity(trainer.model, x.to(device), adapter.schedule(K, setting["height"],
                                     setting["width"]).timesteps[0], {k: v[:N] for k, v in embeds.items()}, g)
            t = _median_times({"pipe": tracker.wrap("pipe", pipe_call), "trl": tracker.wrap("rollout", trl_sample)},
                              repeats, 0)
            res["rollout"] = {"samples": n, "chunk": N, "trl_s": t["trl"], "pipe_s": t["pipe"],
                              "trl_step_s": t["trl"] / K, "pipe_step_s": t["pipe"] / K,
                              "ratio": t["trl"] / t["pipe"], "peak_gib": tracker.peaks.get("rollout"),
                              "pipe_peak_gib": tracker.peaks.get("pipe")}
            save()

            # ---------------------------------------------------------------------------- decode
            res["stage"] = "decode"
            rollout = held["rollout"]
            t = _median_times({"decode": tracker.wrap("decode", lambda: trainer.decode(rollout.states[:, -1]))}, 1, 0)
            res["decode"] = {"s": t["decode"], "per_sample_s": t["decode"] / n,
                             "peak_gib": tracker.peaks.get("decode")}
            save()

            # ---------------------------------------------------------------------------- update vs fwd + bwd
            res["stage"] = "update"
            rollout.rewards = torch.linspace(0, 1, n)
            trainer.compute_advantages(rollout)
            model, trained = trainer.model, rollout.trained_steps()
            calls = []
            for lo in range(0, n, N):
                idx = torch.arange(lo, min(lo + N, n))
                for k in trained:
                    calls += record_transformer_calls(
                        model, lambda: trainer.forward_step(rollout, idx, k, need_ref=False))
            beta = config.beta
            model.train()  # warm-up of the backward kernels: one recorded call
            with trainer._autocast():
                v = model(**calls[0])[0]
            sum(x.float().pow(2).mean() for x in (v if isinstance(v, (list, tuple)) else [v])).backward()
            for p in trainer.trainable_params:
                p.grad = None

            def fwd_bwd():
                model.train()
                for kw in calls:
                    with trainer._autocast():
                        v = model(**kw)[0]
                    vs = v if isinstance(v, (list, tuple)) else [v]  # Z-Image returns one tensor per sample
                    sum(x.float().pow(2).mean() for x in vs).backward()
                    if beta > 0:
                        with torch.no_grad(), trainer.reference_policy() as ref, trainer._autocast():
                            ref(**kw)
                for p in trainer.trainable_params:
                    p.grad = None

            t = _median_times({"fwd_bwd": tracker.wrap("fwd_bwd", fwd_bwd),
                               "trl": tracker.wrap("update", lambda: trainer.optimize(rollout, 0))}, repeats, 0)
            res["update"] = {"trained_steps": len(trained), "transformer_calls": len(calls), "trl_s": t["trl"],
                             "fwd_bwd_s": t["fwd_bwd"], "trl_step_s": t["trl"] / max(1, len(trained)),
                             "ratio": t["trl"] / t["fwd_bwd"], "baseline": "fwd+bwd" + (" + ref fwd" if beta else ""),
                             "peak_gib": tracker.peaks.get("update"), "fwd_bwd_peak_gib": tracker.peaks.get("fwd_bwd")}
            # ---------------------------------------------------------------------------- training iterations
            # the overhead stages' tensors (rollout, recorded calls): dropped, so the iterations' peaks exclude them
            held = rollout = calls = embeds = pipe_embeds = x = v = None
            _free_memory(device)
            res["iterations"] = {}
            for i, label in enumerate(settings):
                res["stage"] = f"iteration:{label}"
                res["iterations"][label] = run_iteration(trainer, config, label, SETTINGS[label], tracker, device,
                                                         1 + i * repeats, repeats)
                save()
            res["status"], res["stage"] = "ok", "done"
    except torch.OutOfMemoryError as e:
        res["status"], res["error"] = "oom", f"{res['stage']}: {str(e).splitlines()[0]}"
    except Exception as e:  # recorded, so that one family's failure does not hide the others' results
        res["status"], res["error"] = "error", f"{res['stage']}: {type(e).__name__}: {e}"
    if tracker.cuda:
        res["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
    else:
        res["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    save()
    return res


def dry_run(name: str) -> dict:
    """Build the full-size family on the meta device (no memory, no compute): checks that the configs build, and
    gives parameter counts, the published setting, latent and embedding shapes and the rollout's bytes per sample."""
    from trl_flow.models import get_adapter

    spec = SPECS[name]
    setting, source = published_setting(spec)
    pipe, small = build_pipeline(name, False, torch.device("meta"), torch.bfloat16)
    adapter = get_adapter(pipe)
    template = embed_template(get_adapter(small), setting["guidance_scale"] > 1, TINY_SETTING["max_sequence_length"])
    shapes = full_shapes(template, spec.text, setting["max_sequence_length"], False)
    h, w = setting["height"], setting["width"]
    if h % adapter.resolution_multiple or w % adapter.resolution_multiple:
        raise ValueError(f"{name}: {h} x {w} is not a multiple of {adapter.resolution_multiple}")
    adapter.check_size(h, w)
    if "num_frames" in setting and hasattr(adapter, "num_frames"):
        adapter.num_frames = setting["num_frames"]
    K = setting["num_inference_steps"]
    return {"family": name, "status": "ok", "setting": setting, "setting_source": source,
            "transformer_params_b": round(sum(p.numel() for k in ("transformer", *spec.extra_transformers)
                                              for p in getattr(pipe, k).parameters()) / 1e9, 3),
            "vae_params_m": round(sum(p.numel() for p in pipe.vae.parameters()) / 1e6, 1),
            "embeddings": {k: list(s) for k, (s, _) in shapes.items()},
            "latent_shape": list(adapter.latent_shape(h, w)),
            "rollout_mb_per_sample": round(adapter.rollout_bytes(1, K, h, w) / 1e6, 3)}


# ----------------------------------------------------------------------------------------------- table
TABLE_START = "<!-- full-size table: generated by benchmarks/full_size.py --table -->"
TABLE_END = "<!-- end of full-size table -->"
TABLE_HEADER = ("| Family | Setting | Resolution x frames x batch | Steps (run / published) | Rollout images/s "
                "| Update images/s | Iteration images/s | Peak memory GiB | MFU |")
NOT_ON_GPU = "not run on a GPU yet"


def _shape_cell(name: str, setting: dict) -> str:
    spec = SPECS.get(name)
    video = "num_frames" in (spec.setting if spec is not None else setting)
    frames = f" x {setting['num_frames']}" if video and "num_frames" in setting else ""
    batch = max(2, int(setting.get("per_device_train_batch_size", 2)))  # the run's group: at least 2 samples
    return f"{setting.get('height')} x {setting.get('width')}{frames} x {batch}"


def _num(value, fmt="{:.3g}") -> str:
    return "n/a" if value is None else fmt.format(value)


def render_table(data: dict) -> str:
    """A markdown table of a full_size JSON (``data``: the parsed file): one row per family and setting
    (:data:`SETTINGS`) with images per second of the rollout, the update and the whole iteration, the peak memory
    and the MFU estimate. A dry-run or ``--tiny`` JSON (no GPU numbers) gives rows that say so."""
    meta = data.get("meta", {})
    on_gpu = bool(meta.get("gpu")) and not meta.get("dry_run") and not meta.get("tiny")
    if on_gpu:
        caption = (f"{meta['gpu']}, torch {meta.get('torch')}, {meta.get('date')}; bf16, random weights, LoRA; "
                   "images per GPU-second at the steps run (see the JSON's iterations_note); batch: the samples of an "
                   "iteration (one group of at least 2).")
    else:
        kind = "dry run (meta device)" if meta.get("dry_run") else "tiny CPU run" if meta.get("tiny") else "CPU run"
        caption = (f"Not run on a GPU yet: the JSON holds a {kind} of {meta.get('date')}; the sizes are the "
                   "published settings, batch: the samples of an iteration (one group of at least 2).")
    lines = [caption, "", TABLE_HEADER, "|" + "---|" * TABLE_HEADER.count(" | ") + "---|"]
    for name, r in data.get("families", {}).items():
        if on_gpu or name not in SPECS:
            setting = r.get("setting") or {}
            steps = f"{r.get('steps_run', '-')} / {r.get('steps_published', setting.get('num_inference_steps', '-'))}"
        else:  # a tiny run's setting is the tiny one: show the published setting
            setting = published_setting(SPECS[name])[0]
            steps = f"- / {setting['num_inference_steps']}"
        shape = _shape_cell(name, setting) if setting else "n/a"
        for label in (meta.get("settings") or SETTINGS) if on_gpu else SETTINGS:
            it = r.get("iterations", {}).get(label)
            if not on_gpu:
                cells = [NOT_ON_GPU, "-", "-", "-", "-"]
            elif it is None or it.get("status") != "ok":
                why = (it or {}).get("error") or r.get("reason") or r.get("error") or "not measured"
                status = (it or {}).get("status") if it else r.get("status")
                cells = [f"{status}: {why}".replace("|", "/")[:120], "-", "-", "-", "-"]
            else:
                mfu = it.get("mfu")
                cells = [_num(it.get("rollout_images_per_s")), _num(it.get("update_images_per_s")),
                         _num(it.get("iteration_images_per_s")), _num(it.get("peak_gib"), "{:.1f}"),
                         "n/a" if mfu is None else f"{100 * mfu:.1f}%"]
            lines.append(f"| {name} | {label} | {shape} | {steps} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_table(page_path: str, json_path: str) -> str:
    """Replace what lies between :data:`TABLE_START` and :data:`TABLE_END` in ``page_path`` with the table of
    ``json_path``; returns the table. The page must hold both markers, in that order (a ValueError otherwise)."""
    with open(json_path, encoding="utf-8") as f:
        table = render_table(json.load(f))
    with open(page_path, encoding="utf-8") as f:
        page = f.read()
    start = page.find(TABLE_START)
    end = page.find(TABLE_END, start + len(TABLE_START)) if start >= 0 else -1
    if start < 0 or end < 0:
        raise ValueError(f"{page_path}: needs the markers {TABLE_START!r} and then {TABLE_END!r}")
    page = page[:start + len(TABLE_START)] + "\n" + table + page[end:]
    with open(page_path, "w", encoding="utf-8") as f:
        f.write(page)
    return table


# ----------------------------------------------------------------------------------------------- driver
def run_isolated(name: str, args, budget: float) -> dict:
    """One family in a fresh process, killed after ``budget`` seconds (its finished stages are kept)."""
    with tempfile.TemporaryDirectory() as tmp:
        partial = os.path.join(tmp, "result.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--one", name, "--partial", partial,
               "--repeats", str(args.repeats), "--settings", *args.settings] + (["--tiny"] if args.tiny else []) + (
               ["--steps", str(args.steps)] if args.steps else [])
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(1.0, budget))
            status = None if proc.returncode == 0 else f"exited {proc.returncode}: {proc.stderr[-1500:]}"
        except subprocess.TimeoutExpired:
            status = "timeout"
        res = {"family": name, "status": "error", "stage": "start"}
        if os.path.exists(partial):
            with open(partial) as f:
                res = json.load(f)
        if status == "timeout":
            res["status"], res["error"] = "timeout", f"{res.get('stage')}: over its budget of {budget:.0f} s"
        elif status is not None and res.get("status") in ("running", "error"):
            res["status"], res["error"] = "error", res.get("error") or status
        res["wall_s"] = time.perf_counter() - t0
        res["budget_s"] = budget
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("--families", nargs="+", default=None, help=f"subset of {list(SPECS)} (default: all)")
    ap.add_argument("--tiny", action="store_true", help="tiny configs on the CPU, float32 (seconds; the tests)")
    ap.add_argument("--dry-run", action="store_true",
                    help="only build the full-size configs on the meta device (no memory, no GPU): parameter counts, "
                         "shapes, the published settings")
    ap.add_argument("--steps", type=int, default=None, help="sampling steps (default: each family's bench_steps; "
                                                            "never more than its published steps)")
    ap.add_argument("--repeats", type=int, default=1, help="timed repeats of each measurement (medians)")
    ap.add_argument("--time-limit", type=float, default=450.0, help="seconds for the whole run (GPU)")
    ap.add_argument("--isolate", choices=("auto", "process", "none"), default="auto",
                    help="one process per family with its budget (auto: on the GPU, not with --tiny)")
    ap.add_argument("--out", default=None, help="JSON to write (default: benchmarks/results/full_size.json; with "
                                                "--tiny full_size_tiny.json, with --dry-run full_size_dry_run.json)")
    ap.add_argument("--table", nargs="?", const="", default=None, metavar="JSON",
                    help="print the markdown table of a full_size JSON (default: benchmarks/results/full_size.json, "
                         "else full_size_dry_run.json) "
                         "and run nothing; with --page, also write it into that page between its markers")
    ap.add_argument("--settings", nargs="*", default=list(SETTINGS), choices=list(SETTINGS),
                    help="training iterations to measure per family (default: all; none: only the overhead stages)")
    ap.add_argument("--page", default=None, help="with --table: the page to update (e.g. docs/performance.md)")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--partial", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.table is not None:
        results_dir = os.path.join(ROOT, "benchmarks", "results")
        found = [p for p in (os.path.join(results_dir, f) for f in ("full_size.json", "full_size_dry_run.json"))
                 if os.path.exists(p)]
        path = args.table or (found or [os.path.join(results_dir, "full_size.json")])[0]
        if args.page:
            table = write_table(args.page, path)
        else:
            with open(path, encoding="utf-8") as f:
                table = render_table(json.load(f))
        print(table, end="")
        return table
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.out is None:
        suffix = "_dry_run" if args.dry_run else "_tiny" if args.tiny else ""
        args.out = os.path.join(ROOT, "benchmarks", "results", f"full_size{suffix}.json")
    if args.tiny:
        torch.set_num_threads(1)
    if args.one:
        measure(args.one, args.tiny, args.steps, args.repeats, args.partial, tuple(args.settings))
        return None
    names = args.families or list(SPECS)
    unknown = [f for f in names if f not in SPECS]
    if unknown:
        raise SystemExit(f"--families: unknown {unknown}; choose from {list(SPECS)}")
    if args.dry_run:
        results = {}
        for name in names:
            reason = availability(name)
            try:
                results[name] = dry_run(name) if reason is None else {"family": name, "status": "skipped",
                                                                       "reason": reason}
            except Exception as e:
                results[name] = {"family": name, "status": "error", "error": f"{type(e).__name__}: {e}"}
            r = results[name]
            print(f"{name:>22}: {r['status']:<8} {r.get('reason') or r.get('error') or ''}"
                  f"{r.get('transformer_params_b', '')}", flush=True)
        with open(args.out, "w") as f:
            json.dump({"meta": {"dry_run": True, "date": time.strftime("%Y-%m-%d")}, "families": results}, f,
                      indent=1)
        return results
    if not args.tiny and not torch.cuda.is_available():
        raise SystemExit("benchmarks/full_size.py needs a CUDA GPU (full-size models); use --tiny on the CPU")
    isolate = args.isolate == "process" or (args.isolate == "auto" and not args.tiny)
    start = time.perf_counter()
    results = {}
    for name in names:
        reason = availability(name)
        left = args.time_limit - (time.perf_counter() - start)
        if reason is not None:
            results[name] = {"family": name, "status": "skipped", "reason": reason}
        elif isolate and left < 20:
            results[name] = {"family": name, "status": "skipped", "reason": f"--time-limit {args.time_limit:.0f} s "
                                                                             "reached before this family"}
        elif isolate:
            results[name] = run_isolated(name, args, min(SPECS[name].budget_s, left))
        else:
            t0 = time.perf_counter()
            results[name] = measure(name, args.tiny, args.steps, args.repeats, None, tuple(args.settings))
            results[name]["wall_s"] = time.perf_counter() - t0
        r = results[name]
        line = r.get("reason") or r.get("error") or (
            f"rollout/pipe {r['rollout']['ratio']:.3f}, update/fwd+bwd {r['update']['ratio']:.3f}, "
            f"peak {r.get('peak_gib', r.get('peak_rss_mib'))}")
        print(f"{name:>22}: {r['status']:<8} {line}", flush=True)
        for label, it in r.get("iterations", {}).items():
            line = it.get("error") or (
                f"images/s rollout {it['rollout_images_per_s']:.3g}, update {it['update_images_per_s']:.3g}, "
                f"iteration {it['iteration_images_per_s']:.3g}; update rows {it['rows/update_transformer']:.0f}; "
                f"peak {it.get('peak_gib')} GiB; MFU {it.get('mfu')}")
            print(f"{'':>22}  {label:<8} {it['status']:<6} {line}", flush=True)
    meta = {"torch": torch.__version__, "platform": platform.platform(), "date": time.strftime("%Y-%m-%d"),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() and not args.tiny else None,
            "tiny": args.tiny, "repeats": args.repeats, "steps": args.steps, "time_limit_s": args.time_limit,
            "wall_s": time.perf_counter() - start,
            "settings": {k: SETTINGS[k] for k in args.settings},
            "iterations_note": ITERATIONS_NOTE}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "families": results}, f, indent=1)
    print(f"wrote {args.out} ({meta['wall_s']:.0f} s)")
    return results


if __name__ == "__main__":
    main()
