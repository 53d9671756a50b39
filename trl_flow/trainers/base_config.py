"""Fields shared by every trl_flow trainer config.

Names follow ``transformers.TrainingArguments`` where the meaning is the same and diffusers' pipeline arguments for
sampling. Every field has ``metadata=meta(resume, help)`` (:mod:`trl_flow.config_fields`): how a resumed run treats a
Invalid values raise ``ValueError`` in ``__post_init__`` naming the field and what is allowed.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from ..config_fields import meta
from ..engine.compute_options import check_attention_backend_name

from ..advantages import SCALE_REWARDS
from ..kernels import SAMPLERS
from ..memory import OFFLOAD_MODES
from .trl_compat import AcceptsTrlNames


GUIDANCE_GRADS = ("cond_only", "both")
#: ``batch_layout``: the order of an iteration's samples (and so of the first update pass's microbatches).
BATCH_LAYOUTS = ("mixed", "by_prompt")
#: ``sde_steps_mode``: where the ``sde_window_size`` stochastic steps sit (consecutive, or drawn one by one).
SDE_STEPS_MODES = ("window", "random")
MAX_SEED = 2**32 - 1

#: `transformers.get_scheduler` names usable here (stepped once per optimizer step, no extra arguments).
LR_SCHEDULERS = ("constant", "constant_with_warmup", "linear", "cosine", "cosine_with_restarts", "polynomial",
                 "inverse_sqrt")


#: ``experts``: which transformers of a multi-expert pipeline are trained (Wan2.2-A14B).
EXPERTS = ("all", "high_noise", "low_noise")
#: ``source_image_size``: the size an editing pipeline (FLUX.1 Kontext, Qwen-Image-Edit) encodes the source image at.
SOURCE_IMAGE_SIZES = ("auto", "source", "output")

@dataclass
class FlowRLConfig(metaclass=AcceptsTrlNames):  # TRL's GRPOConfig names (epsilon, num_iterations): trl_compat.py
    # ---- run ---------------------------------------------------------------------------------------------------
    output_dir: str = field(default="trl_flow_output", metadata=meta("harmless",
        "Where checkpoints, samples and the final LoRA are written."))
    run_name: str | None = field(default=None, metadata=meta("harmless",
        "Name of the run for the trackers (default: the trainer's method name)."))
    seed: int = field(default=42, metadata=meta("notice",
        "Seed of every random draw (prompt order, noise, SDE noise, shuffles). Each iteration derives its own "
        "generators from (seed, step), so a resumed run repeats an uninterrupted one exactly. An integer in [0, "
        "2**32 - 1]."))
    max_steps: int = field(default=100, metadata=meta("harmless",
        "Number of training iterations. One iteration samples `prompts_per_step * num_generations` trajectories, "
        "scores them and runs `num_inner_epochs` passes of updates over them."))
    model_init_kwargs: dict | str | None = field(default=None, metadata=meta("notice",
        "from_pretrained kwargs. Keyword arguments of `DiffusionPipeline.from_pretrained` when the trainer is given a "
        "model id or folder instead of a pipeline: `dtype` (default `auto`: bfloat16 / float16 under bf16 / fp16, "
        "else float32), `variant`, `revision`, ... A dict (a JSON string on the command line)."))
    # ---- batch ---------------------------------------------------------------------------------------------------
    num_generations: int = field(default=8, metadata=meta("refuse",
        "Group size G: trajectories sampled per prompt (published: 24)."))
    prompts_per_step: int = field(default=4, metadata=meta("notice",
        "Distinct prompts (groups) per iteration, over all processes. `prompts_per_step * num_generations` must "
        "divide evenly among processes."))
    per_device_train_batch_size: int = field(default=8, metadata=meta("notice",
        "Trajectories per forward pass on one device, for sampling and for the update."))
    gradient_accumulation_steps: int = field(default=1, metadata=meta("notice",
        "Microbatches (of `per_device_train_batch_size` trajectories, each over all its trained steps) accumulated "
        "per optimizer step."))
    batch_layout: str = field(default="mixed", metadata=meta("notice",
        "Order of an iteration's samples, which the first update pass keeps: `mixed` (default; seeded permutation: "
        "every microbatch holds several prompts, as the released flow_grpo, DiffusionNFT and UniRL code shuffle "
        "before the update) or `by_prompt` (one group after another: a microbatch of G holds one prompt; trl_flow's "
        "layout until 0.1, the committed benchmark runs)."))
    num_inner_epochs: int = field(default=1, metadata=meta("notice",
        "Passes of updates over each rollout. The first pass keeps the rollout's batch composition so the first "
        "ratio is exactly 1; later passes shuffle."))
    # ---- optimisation ------------------------------------------------------------------------------------------
    learning_rate: float = field(default=3e-4, metadata=meta("optimizer",
        "AdamW learning rate (published Flow-GRPO: 3e-4 for LoRA)."))
    adam_beta1: float = field(default=0.9, metadata=meta("optimizer", "AdamW beta1."))
    adam_beta2: float = field(default=0.999, metadata=meta("optimizer", "AdamW beta2."))
    adam_epsilon: float = field(default=1e-8, metadata=meta("optimizer", "AdamW epsilon."))
    weight_decay: float = field(default=1e-4, metadata=meta("optimizer", "AdamW weight decay."))
    optim: str = field(default="adamw_torch", metadata=meta("refuse",
        "Optimizer: `adamw_torch` or `adamw_8bit` (bitsandbytes)."))
    lr_scheduler_type: str = field(default="constant", metadata=meta("optimizer",
        "A `transformers.get_scheduler` name: constant, constant_with_warmup, linear, cosine, cosine_with_restarts, "
        "polynomial or inverse_sqrt."))
    warmup_steps: int = field(default=0, metadata=meta("optimizer", "Warm-up optimizer steps of the LR schedule."))
    max_grad_norm: float = field(default=1.0, metadata=meta("notice", "Gradient clipping norm (0 disables)."))
    bf16: bool = field(default=False, metadata=meta("notice",
        "bf16 mixed precision: frozen weights in bf16, trainable LoRA weights and all kernel math in float32."))
    fp16: bool = field(default=False, metadata=meta("notice",
        "fp16 mixed precision (like bf16, with a gradient scaler)."))
    gradient_checkpointing: bool = field(default=False, metadata=meta("harmless",
        "Enable the transformer's gradient checkpointing to save memory."))
    cache_prompt_embeds: bool = field(default=False, metadata=meta("harmless",
        "Keep every prompt's embeddings (on the CPU) across iterations and evaluations, keyed by all they depend on, "
        "so the text encoders run once per distinct prompt; results are bit for bit those of encoding each time "
        "(Flow-Factory, DanceGRPO and UniRL precompute or cache them). Memory: one embedding per distinct prompt."))
    batch_replay_steps: bool = field(default=False, metadata=meta("notice",
        "Trained steps in one forward. A microbatch's loss terms in ONE transformer forward (UniRL's "
        "`batch_replay_steps`, "
        "Tencent-Hunyuan/UniRL 0c97cfb, unirl/models/types/batched_replay.py:26; its PRs #144/#394: FLUX.2-klein 9B "
        "on 8 GPUs 367 -> 329 s a step). Policy-gradient trainers: the B samples' states at the S trained steps go "
        "in as B*S rows with per-row timesteps and repeated embeddings (the reference policy's forward for beta > 0 "
        "likewise); DiffusionNFT: its T training points (old, current and reference policy). The output is split "
        "back per term, each term's loss is the method's own, and one backward of their sum, weighted as the "
        "per-term backwards are, replaces S. Transformer calls of the update: one per microbatch instead of S. "
        "Memory: S times the activations of one term (B*S rows in one forward). Results agree to float rounding, "
        "not bit for bit (gradients: one backward of the sum). The rollout scored each step with B rows a call, so "
        "a kernel that picks its algorithm by row count (GPU, bf16) can make `ratio_first_max_dev` nonzero, where "
        "the per-step path gives exactly 0; it is logged either way (fp32 CPU, tiny and 6-layer SD3: measured 0). "
        "OP-GRPO recomputes its anchor in the batched geometry."))
    attention_backend: str | None = field(default=None, metadata=meta("notice",
        "Trained transformers' attention backend. None: the pipeline's own. Set at set-up with diffusers' "
        "`set_attention_backend` (Flow-Factory's option; verl-omni uses FA3): an AttentionBackendName value "
        "(`native`, `flash`, `_flash_3`, `sage`, `flex`, ...; diffusers also makes it the process's active "
        "backend). One that cannot run here (missing package, GPU-only on a CPU) is refused at start."))
    compile_repeated_blocks: bool = field(default=False, metadata=meta("notice",
        "Regional compile of the transformers. Flow-Factory's name; as diffusers' "
        "ModelMixin.compile_repeated_blocks, each repeated transformer block is compiled at set-up, after the LoRA "
        "is added. Numerically on-policy but not bit-exact (Flow-Factory: ~1e-5 ratio residual); the first ratio's "
        "deviation is logged as ratio_first_max_dev (policy-gradient methods). The first iterations pay the "
        "compilation."))
    offload: str = field(default="none", metadata=meta("harmless",
        "`none`, or `model`: the text encoders and the VAE wait in CPU memory and move to the device only to encode "
        "prompts / decode images (saves their device memory during sampling and the update; results unchanged)."))
    per_device_reward_batch_size: int | None = field(default=None, metadata=meta("harmless",
        "Images per reward call. Per device (bounds a reward model's memory); default: all of the process's images "
        "of the iteration in one call."))
    # ---- what is trained -----------------------------------------------------------------------------------------
    finetune: str = field(default="lora", metadata=meta("refuse",
        "`lora` (peft adapter on the transformer; the reference policy is the model with adapters disabled) or "
        "`full` (all transformer weights; the reference is a frozen copy)."))
    lora_r: int = field(default=32, metadata=meta("refuse", "LoRA rank (published: 32)."))
    lora_alpha: int = field(default=64, metadata=meta("refuse",
        "LoRA alpha (published: 64), > 0 (the LoRA update is scaled by alpha / r). Saved in the adapter metadata, so "
        "alpha != r round-trips."))
    lora_dropout: float = field(default=0.0, metadata=meta("refuse",
        "LoRA dropout. Must be 0: with dropout the update's first ratio pi_theta / pi_old is not 1 (the rollout ran "
        "without it)."))
    experts: str = field(default="all", metadata=meta("refuse",
        "Which transformers of a pipeline with several are trained: `all`, or for Wan2.2-A14B's two experts "
        "`high_noise` (pipe.transformer) or `low_noise` (pipe.transformer_2). A frozen expert's steps are sampled "
        "deterministically (ODE) and not trained; its weights never change. Pipelines with one transformer: `all`. "
        "Default `all`, as Flow-Factory's Wan2.2 adapter (LoRA on both experts)."))
    lora_target_modules: list[str] | None = field(default=None, metadata=meta("refuse",
        "Modules to adapt; default: the model family's adapter's `default_lora_target_modules` (docs/models.md lists "
        "them: SD3: attn.to_q attn.to_k attn.to_v attn.to_out.0 attn.add_q_proj attn.add_k_proj attn.add_v_proj "
        "attn.to_add_out; FLUX.1: those and ff.net.0.proj ff.net.2 ff_context.net.0.proj ff_context.net.2; Wan: to_q "
        "to_k to_v to_out.0; Qwen-Image, Z-Image, FLUX.2: their diffusers LoRA scripts' targets)."))
    ema_decay: float = field(default=0.0, metadata=meta("notice",
        "EMA of the trained weights (diffusers EMAModel) used for evaluation and `save_model`; 0 disables "
        "(published: 0.9)."))
    # ---- sampling ----------------------------------------------------------------------------------------------
    sampler: str = field(default="flow_sde", metadata=meta("refuse",
        "Transition kernel of the rollout: `flow_sde` (Flow-GRPO), `cps` (coefficients-preserving), `ddim` "
        "(Stepwise-Flow-GRPO) or `ode`."))
    noise_level: float = field(default=0.7, metadata=meta("refuse",
        "Kernel noise: `a` for flow_sde/cps, `eta` for ddim (published flow_sde: 0.7)."))
    num_inference_steps: int = field(default=10, metadata=meta("notice",
        "Sampling steps of the rollout (published: 10)."))
    guidance_scale: float = field(default=4.5, metadata=meta("notice",
        "Guidance scale of the rollout and the update, >= 0, applied as the family's pipeline does (published SD3.5: "
        "4.5): SD3 / Wan / Qwen-Image / FLUX.2 [klein] base: true CFG, <= 1 means one unguided pass; FLUX.1-dev / "
        "FLUX.2-dev: the distilled guidance embedding; Z-Image: any value > 0 guides (cond + g (cond - uncond)). "
        "docs/models.md, per family."))
    guidance_scale_2: float | None = field(default=None, metadata=meta("notice",
        "Wan2.2-A14B: CFG scale of the low-noise expert (transformer_2), WanPipeline's guidance_scale_2 "
        "(guidance_scale then guides the high-noise expert; published: 4.0 high / 3.0 low). None: guidance_scale. "
        "Pipelines without transformer_2: leave None."))
    source_image_size: str = field(default="auto", metadata=meta("notice",
        "Editing: source image size. Image editing (FLUX.1 Kontext, Qwen-Image-Edit; a `source_image` dataset "
        "column): the size the source image "
        "is encoded at. `auto`: the pipeline's default: FluxKontextPipeline's `_auto_resize`, the preferred Kontext "
        "resolution nearest the source's aspect ratio; Qwen-Image-Edit's 1024 x 1024 area at the source's aspect "
        "ratio (either about 1 MP: 4096 source tokens next to 1024 generated ones at 512 px); `source`: the source's "
        "own size (multiple of 16; Qwen-Image-Edit: its area); `output`: resized to height x width, as Flow-GRPO's "
        "Kontext training does (Qwen-Image-Edit: that area at the source's aspect ratio, Flow-Factory's "
        "`condition_image_size`). Other pipelines: leave `auto`."))
    height: int = field(default=512, metadata=meta("notice", "Image height in pixels."))
    width: int = field(default=512, metadata=meta("notice", "Image width in pixels."))
    num_frames: int = field(default=33, metadata=meta("notice",
        "Frames per video for video pipelines (Wan: 4k + 1; published Wan2.1 recipe: 33 at 240x416). Image pipelines "
        "ignore it."))
    max_sequence_length: int = field(default=256, metadata=meta("notice",
        "Prompt length in tokens, >= 1, as the pipeline's own `max_sequence_length` (SD3 / FLUX.1: the T5 length; "
        "Qwen-Image, Z-Image, FLUX.2: the text encoder's; pipelines without one ignore it)."))
    same_noise_per_group: bool = field(default=False, metadata=meta("notice",
        "Give all trajectories of a group the same initial noise."))
    shared_prefix: bool = field(default=False, metadata=meta("notice",
        "ODE prefix once per group. Needs same_noise_per_group. The deterministic steps before an iteration's "
        "first stochastic step run once per group, on one row, and the group's G samples branch from that state: "
        "those steps cost P rows instead of P x G. Flow-GRPO-Fast (yifan123/flow_grpo README: sampling before "
        "branching needs a single prompt without group expansion; scripts/train_sd3_fast.py at 74db691 keeps the "
        "sde_window_size ODE steps but samples them per sample). The stored states before the branch are the group's "
        "(never trained), so the update and the first ratio (exactly 1) are unchanged; results differ from False only "
        "in float rounding (a GEMM's last bits depend on its row count). Nothing to share when the first step is "
        "stochastic (sde_window_size 0 without a frozen expert); DiffusionNFT with a stochastic sampler shares its "
        "ODE steps as well. Logged: rows/rollout_transformer."))
    sde_window_size: int = field(default=0, metadata=meta("notice",
        "Flow-GRPO-Fast / MixGRPO window: if > 0, only this many steps are stochastic (consecutive, start drawn in "
        "[0, sde_window_range); placed by `sde_steps_mode`), ODE elsewhere, and only they are trained. 0: every step "
        "but the last."))
    sde_window_range: int | None = field(default=None, metadata=meta("notice",
        "Range of the window's start. Window starts (`sde_steps_mode='random'`: the steps) are drawn in [0, "
        "sde_window_range); default num_inference_steps // 2."))
    timestep_fraction: float = field(default=1.0, metadata=meta("notice",
        "Share of the schedule's K steps the update trains: the trained steps below int(K x fraction), as "
        "flow_grpo's train.timestep_fraction (its maintainer: 0.5 'speeds up training'; DanceGRPO / MixGRPO 0.6); "
        "1 trains every stochastic step. DiffusionNFT: T = int(K x fraction) training timesteps per sample."))
    sde_steps_mode: str = field(default="window", metadata=meta("notice",
        "`window` or `random`. How the sde_window_size stochastic (trained) steps are placed, ODE elsewhere, drawn "
        "from (seed, step): `window` (default, Flow-GRPO-Fast / MixGRPO): consecutive, start in [0, "
        "sde_window_range); `random`: sde_window_size distinct steps in [0, sde_window_range), UniRL's "
        "AllSDEScheduler (its Flow-DPPO recipe: 3 of steps 0-4 of 10)."))
    # ---- objective -----------------------------------------------------------------------------------------------
    beta: float = field(default=0.04, metadata=meta("notice",
        "Weight of the KL to the reference policy (published: 0.04 GenEval/OCR, 0.01 PickScore, tuned with "
        "kl_form='reference'). 0 skips the reference forward pass."))
    guidance_grad: str = field(default="cond_only", metadata=meta("notice",
        "Gradient through classifier-free guidance in the update. `cond_only` (default, the Flow-GRPO reference "
        "code): the unconditional branch is detached, so only the conditional branch is trained; `both`: "
        "back-propagate through both branches (the exact gradient of the guided policy; gives the unconditional "
        "branch the weight 1 - guidance_scale). Rollout values and log-probs are identical either way."))
    reward_weights: list[float] | None = field(default=None, metadata=meta("notice",
        "One weight per reward function (default: all 1)."))
    scale_rewards: str = field(default="batch", metadata=meta("notice",
        "Advantage std (the mean is always the group's): `batch` (default; std over the whole gathered batch, the "
        "reference SD3 recipes' global_std=True), `group` (std over the group, the paper's formula) or `none`."))
    reward_num_workers: int = field(default=0, metadata=meta("notice",
        "Threads that decode and score each sampled microbatch while the next one is sampled (scores are the same; "
        "each reward call sees one microbatch, from a worker thread). 0: decode and score the whole batch after "
        "sampling."))
    reward_timeout: float | None = field(default=900.0, metadata=meta("harmless",
        "Seconds one reward call (one reward function on one batch of per_device_reward_batch_size images) may take; "
        "a call still running then fails the iteration with a RewardError naming the reward, before any update, and "
        "the process can exit (a Python thread cannot be stopped: the call is left running in a background daemon "
        "thread). Default 900 (15 min), above a remote reward's own worst case (4 attempts of 120 s); 0 or None: no "
        "limit. The start-up check call, which also loads a reward model's weights, has no limit."))
    adv_clip_max: float = field(default=5.0, metadata=meta("notice",
        "Advantages are clipped to +-adv_clip_max (> 0)."))
    # ---- evaluation, logging, checkpoints -------------------------------------------------------------------
    eval_steps: int = field(default=0, metadata=meta("harmless",
        "Evaluate every this many iterations (and before the first and after the last); 0 disables. Needs an "
        "eval_dataset."))
    eval_num_inference_steps: int = field(default=40, metadata=meta("harmless",
        "ODE steps of the evaluation sampler (published: 40)."))
    eval_guidance_scale: float | None = field(default=None, metadata=meta("harmless",
        "Guidance of the evaluation (default: guidance_scale)."))
    eval_height: int | None = field(default=None, metadata=meta("harmless",
        "Height of evaluation and generate(). None: `height` (Flow-Factory's separate eval resolution; asked for "
        "in yifan123/flow_grpo#201). A multiple of the pipeline's resolution multiple (checked at construction); "
        "text-to-image and video pipelines only (an editing pipeline sizes its source conditioning for height x "
        "width)."))
    eval_width: int | None = field(default=None, metadata=meta("harmless",
        "Width of evaluation and generate(). None: `width`; as `eval_height`."))
    per_device_eval_batch_size: int = field(default=16, metadata=meta("harmless",
        "Images per forward pass in evaluation."))
    logging_steps: int = field(default=1, metadata=meta("harmless", "Log metrics every this many iterations."))
    log_images_steps: int = field(default=0, metadata=meta("harmless",
        "Write a grid of rollout images to output_dir/samples every this many iterations; 0 disables."))
    report_to: list[str] | str = field(default_factory=list, metadata=meta("harmless",
        "Trackers: none (the default, []), all, wandb, tensorboard, or a list; tensorboard writes to "
        "output_dir/<run_name>."))
    save_steps: int = field(default=0, metadata=meta("harmless",
        "Save a resumable checkpoint (accelerate save_state) every this many iterations; 0 disables."))
    save_total_limit: int | None = field(default=None, metadata=meta("harmless",
        "Keep at most this many checkpoints (oldest deleted)."))
    resume_from_checkpoint: str | None = field(default=None, metadata=meta("harmless",
        "Checkpoint folder to resume from, or `latest` for the newest complete one in output_dir. Same as "
        "train(resume_from_checkpoint=...)."))
    check_free_space: bool = field(default=True, metadata=meta("harmless",
        "At the start, refuse an output_dir whose disk cannot hold the final weights (warn when it cannot also "
        "hold two checkpoints); False goes on anyway. A failed final save writes the weights to a fallback folder "
        "($TRL_FLOW_RESCUE_DIR, ~/.cache/trl_flow/rescue/<run>, $TMPDIR/trl_flow-rescue/<run>) named in the "
        "error."))
    overwrite_output_dir: bool = field(default=False, metadata=meta("harmless",
        "Start a new (not resumed) run in an output_dir that holds an earlier run's outputs: first deletes them, "
        "each by name directly inside output_dir (its checkpoint-* folders, final LoRA file or saved pipeline, "
        "log_history.jsonl, samples/, tensorboard folders, abandoned-after-step-* folders), listing each path "
        "first; other files are left alone. Without it such a run is refused. A folder holding a diffusers "
        "pipeline that no trl_flow run wrote (e.g. the base model's) is refused even with it."))
    push_to_hub: bool = field(default=False, metadata=meta("harmless",
        "At the end of train(), after the final model is saved in output_dir, upload it (LoRA or pipeline) to the "
        "Hub with a model card. The Hub is checked at start; if the upload fails at the end, the model stays in "
        "output_dir and the error gives the command that pushes it later."))
    hub_model_id: str | None = field(default=None, metadata=meta("harmless",
        "Hub repository (default: the output_dir's name)."))
    hub_private_repo: bool | None = field(default=None, metadata=meta("harmless",
        "Create the Hub repository as private."))
    hub_base_model: str | None = field(default=None, metadata=meta("notice",
        "Hub id of the base model written in the model card (default: the pipeline's own name when it is a Hub id; a "
        "local path is never written)."))
    hub_license: str | None = field(default=None, metadata=meta("notice",
        "License of the pushed model (default: the base model's license, read from its Hub card)."))
    hub_include_replay_buffer: bool = field(default=False, metadata=meta("notice",
        "Also upload the trainer's replay buffer (OP-GRPO), as a `datasets` folder `replay_buffer/` of the model "
        "repository."))
    peak_tflops: float | None = field(default=None, metadata=meta("harmless",
        "Device peak TFLOPS for throughput/mfu. The metric is achieved `throughput/tflops` / peak "
        "(verl-omni's diffusion MFU). None: the dense bf16 peak of a known GPU (trl_flow/engine/throughput.py, vendor "
        "datasheets: H100/H200 SXM 989, A100 312, L40S 362, ...); a CPU or unknown GPU logs tflops only."))
    disable_tqdm: bool = field(default=False, metadata=meta("harmless", "Hide the progress bar."))
    # ---- several processes ---------------------------------------------------------------------------------
    ddp_timeout: float = field(default=1200.0, metadata=meta("notice",
        "Seconds a collective operation (a gather, the gradient all-reduce, a barrier) waits for the other processes "
        "before it fails with an error naming this option: how long a run with a stopped or hung process waits "
        "before it stops by itself. Default 1200 (20 min), shorter than torch's 30 min for gloo and above "
        "reward_timeout's 900 s, so that a slow reward call on one process fails as its own RewardError first; it "
        "must also cover what one process does alone while the others wait (the main process's saves and Hub "
        "upload). Same name as transformers' TrainingArguments.ddp_timeout."))

    def _need(self, cond, name: str, msg: str) -> None:
        """``ValueError`` naming the field, its value and what is allowed, unless ``cond``."""
        if not cond:
            raise ValueError(f"{type(self).__name__}.{name}={getattr(self, name)!r}: {msg}")

    def __post_init__(self):
        need = self._need

        for name in ("max_steps", "num_generations", "prompts_per_step", "per_device_train_batch_size",
                     "gradient_accumulation_steps", "num_inner_epochs", "num_inference_steps",
                     "eval_num_inference_steps", "per_device_eval_batch_size", "height", "width", "num_frames",
                     "lora_r",
                     "logging_steps", "max_sequence_length"):
            need(isinstance(getattr(self, name), int) and getattr(self, name) >= 1, name, "must be an integer >= 1")
        for name in ("eval_height", "eval_width"):
            need(getattr(self, name) is None or isinstance(getattr(self, name), int)
                 and not isinstance(getattr(self, name), bool) and getattr(self, name) >= 1, name,
                 "must be an integer >= 1, or None (the training size)")
        for name in ("eval_steps", "save_steps", "log_images_steps", "warmup_steps", "sde_window_size"):
            need(isinstance(getattr(self, name), int) and getattr(self, name) >= 0, name, "must be an integer >= 0")
        need(self.num_generations >= 2, "num_generations", "must be >= 2: a group of one has no relative advantage")
        need(isinstance(self.seed, int) and not isinstance(self.seed, bool) and 0 <= self.seed <= MAX_SEED, "seed",
             f"must be an integer in [0, {MAX_SEED}] (2**32 - 1, numpy's seed range; the torch generators' seeds "
             "are derived from it)")
        need(self.num_inference_steps >= 2, "num_inference_steps", "must be >= 2 (the last step is never trained)")
        need(self.sampler in SAMPLERS, "sampler", f"must be one of {SAMPLERS}")
        need(self.batch_layout in BATCH_LAYOUTS, "batch_layout", f"must be one of {BATCH_LAYOUTS}")
        need(self.scale_rewards in SCALE_REWARDS, "scale_rewards", f"must be one of {SCALE_REWARDS}")
        need(self.guidance_grad in GUIDANCE_GRADS, "guidance_grad", f"must be one of {GUIDANCE_GRADS}")
        need(self.sde_steps_mode in SDE_STEPS_MODES, "sde_steps_mode", f"must be one of {SDE_STEPS_MODES}")
        need(isinstance(self.timestep_fraction, (int, float)) and not isinstance(self.timestep_fraction, bool)
             and 0 < self.timestep_fraction <= 1, "timestep_fraction", "must be in (0, 1]")
        need(self.num_train_timesteps >= 1, "timestep_fraction",
             f"int(num_inference_steps * timestep_fraction) = int({self.num_inference_steps} * "
             f"{self.timestep_fraction}) = 0 trains no timestep; raise it or num_inference_steps")
        need(self.finetune in ("lora", "full"), "finetune", "must be `lora` or `full`")
        need(self.optim in ("adamw_torch", "adamw_8bit"), "optim", "must be `adamw_torch` or `adamw_8bit`")
        need(math.isfinite(self.noise_level) and self.noise_level > 0, "noise_level",
             "must be > 0 (0 makes every step deterministic: nothing to train)")
        if self.sampler in ("cps", "ddim"):
            need(self.noise_level <= 1, "noise_level", f"must be in (0, 1] for sampler={self.sampler!r}")
        for name in ("learning_rate",):
            need(math.isfinite(getattr(self, name)) and getattr(self, name) > 0, name, "must be a positive number")
        for name in ("beta", "weight_decay", "max_grad_norm", "adv_clip_max", "lora_dropout"):
            need(math.isfinite(getattr(self, name)) and getattr(self, name) >= 0, name, "must be a finite number >= 0")
        need(isinstance(self.reward_num_workers, int) and self.reward_num_workers >= 0, "reward_num_workers",
             "must be an integer >= 0 (0: score after sampling)")
        need(self.reward_timeout is None or isinstance(self.reward_timeout, (int, float))
             and not isinstance(self.reward_timeout, bool) and math.isfinite(self.reward_timeout)
             and self.reward_timeout >= 0, "reward_timeout",
             "must be a finite number of seconds >= 0 (0 or None: no limit)")
        need(isinstance(self.ddp_timeout, (int, float)) and not isinstance(self.ddp_timeout, bool)
             and math.isfinite(self.ddp_timeout) and self.ddp_timeout > 0, "ddp_timeout",
             "must be a finite number of seconds > 0")
        need(not self.reward_timeout or self.ddp_timeout > self.reward_timeout, "ddp_timeout",
             f"must be > reward_timeout={self.reward_timeout!r}: the other processes wait in a collective while one "
             "process's reward call runs, so they would time out before that call does; raise ddp_timeout or lower "
             "reward_timeout")
        need(self.adv_clip_max > 0, "adv_clip_max", "must be > 0: 0 clips every advantage to 0 and nothing is trained")
        need(math.isfinite(self.lora_alpha) and self.lora_alpha > 0, "lora_alpha",
             "must be > 0: the LoRA update is scaled by lora_alpha / lora_r, so 0 never changes the model")
        need(self.lora_dropout == 0, "lora_dropout", "must be 0: with dropout the first ratio pi_theta / pi_old of "
             "the update is not 1 (the rollout was sampled without dropout), which breaks the clipped objective")
        for name in ("guidance_scale", "eval_guidance_scale"):
            v = getattr(self, name)
            need(v is None and name == "eval_guidance_scale" or v is not None and math.isfinite(v) and v >= 0, name,
                 "must be a finite number >= 0 (<= 1: one unguided pass)")
        need(self.experts in EXPERTS, "experts", f"must be one of {EXPERTS}")
        need(self.source_image_size in SOURCE_IMAGE_SIZES, "source_image_size", f"must be one of {SOURCE_IMAGE_SIZES}")
        need(self.guidance_scale_2 is None or isinstance(self.guidance_scale_2, (int, float))
             and not isinstance(self.guidance_scale_2, bool) and math.isfinite(self.guidance_scale_2)
             and self.guidance_scale_2 >= 0, "guidance_scale_2",
             "must be a finite number >= 0, or None (= guidance_scale)")
        need(self.lr_scheduler_type in LR_SCHEDULERS, "lr_scheduler_type", f"must be one of {LR_SCHEDULERS}")
        need(check_attention_backend_name(self.attention_backend) is None, "attention_backend",
             str(check_attention_backend_name(self.attention_backend)))
        need(self.peak_tflops is None or isinstance(self.peak_tflops, (int, float))
             and not isinstance(self.peak_tflops, bool) and math.isfinite(self.peak_tflops) and self.peak_tflops > 0,
             "peak_tflops", "must be a finite number > 0, or None (the device's known peak)")
        need(isinstance(self.compile_repeated_blocks, bool), "compile_repeated_blocks", "must be True or False")
        need(self.offload in OFFLOAD_MODES, "offload", f"must be one of {OFFLOAD_MODES}")
        need(self.per_device_reward_batch_size is None or isinstance(self.per_device_reward_batch_size, int)
             and self.per_device_reward_batch_size >= 1, "per_device_reward_batch_size",
             "must be an integer >= 1 or None")
        need(0 <= self.ema_decay < 1, "ema_decay", "must be in [0, 1) (0 disables EMA)")
        need(not (self.bf16 and self.fp16), "bf16", "bf16 and fp16 cannot both be set")
        if self.sde_window_size:
            need(self.sde_window_size < self.num_inference_steps, "sde_window_size",
                 f"must be < num_inference_steps={self.num_inference_steps}")
            rng = self.sde_window_range if self.sde_window_range is not None else max(1, self.num_inference_steps // 2)
            if self.sde_steps_mode == "random":
                need(self.sde_window_size <= rng <= self.num_inference_steps - 1, "sde_window_range",
                     f"sde_steps_mode='random' draws {self.sde_window_size} distinct steps in [0, {rng}): the range "
                     f"must hold them and end before the last step ({self.num_inference_steps - 1})")
            else:
                need(rng >= 1 and rng + self.sde_window_size - 1 <= self.num_inference_steps - 1, "sde_window_range",
                     f"window starts in [0, {rng}) plus size {self.sde_window_size} must end before the last step "
                     f"({self.num_inference_steps - 1})")
        need(isinstance(self.shared_prefix, bool), "shared_prefix", "must be True or False")
        need(not self.shared_prefix or self.same_noise_per_group, "shared_prefix",
             "needs same_noise_per_group=True: only samples that start from the same noise share their deterministic "
             "steps; set same_noise_per_group=True or shared_prefix=False")
        if self.reward_weights is not None:
            need(all(math.isfinite(float(w)) for w in self.reward_weights), "reward_weights",
                 "weights must be finite numbers")
        if isinstance(self.model_init_kwargs, str):  # the command line's JSON string
            import json

            try:
                self.model_init_kwargs = json.loads(self.model_init_kwargs)
            except ValueError as e:
                need(False, "model_init_kwargs", f"not a JSON object ({e})")
        need(self.model_init_kwargs is None or isinstance(self.model_init_kwargs, dict), "model_init_kwargs",
             "must be a dict of DiffusionPipeline.from_pretrained keyword arguments, or None")
        if self.report_to is None:  # TrlParser passes None for an unset list field
            self.report_to = []
        if isinstance(self.report_to, str):
            self.report_to = [] if self.report_to in ("none", "") else [self.report_to]
        from accelerate.utils import LoggerType

        allowed = {t.value for t in LoggerType}
        bad = [r for r in self.report_to if r not in allowed and r != "none"]
        need(not bad, "report_to", f"unknown tracker(s) {bad}; use none, all, wandb or tensorboard")
        self.report_to = [r for r in self.report_to if r != "none"]
        if self.hub_base_model is not None:
            from huggingface_hub.utils import HFValidationError, validate_repo_id

            try:
                validate_repo_id(self.hub_base_model)
            except HFValidationError as e:
                need(False, "hub_base_model", f"must be a Hub id like `org/name` ({e})")
        if self.save_total_limit is not None:
            need(self.save_total_limit >= 1, "save_total_limit", "must be >= 1 or None")

    @property
    def num_train_timesteps(self) -> int:
        """int(num_inference_steps * timestep_fraction): the policy-gradient trainers train the steps below it;
        DiffusionNFT that many training timesteps per sample."""
        return int(self.num_inference_steps * self.timestep_fraction)

    @property
    def train_batch_size(self) -> int:
        """Trajectories per iteration over all processes."""
        return self.prompts_per_step * self.num_generations

    def resolved_defaults(self) -> dict:
        """The values that the fields left at None stand for, under this config (for logs, checkpoints, cards)."""
        return {}

    def to_dict(self) -> dict:
        """The fields as set (None stays None: "the default"); ``resolved_defaults()`` gives what they mean."""
        return asdict(self)

    def resolved_dict(self) -> dict:
        """The fields with those left at None replaced by what they stand for (for logs, checkpoints, cards)."""
        return {**self.to_dict(), **self.resolved_defaults()}
