"""The shared trainer base: prompts -> rollout -> rewards -> (method's advantages) -> (method's loss) -> update.

The run layer. A method subclasses :class:`FlowRLTrainer` (DiffusionNFT) or the policy-gradient layer on it,
:class:`~trl_flow.trainers.policy_gradient_trainer.PolicyGradientTrainer` (Flow-GRPO and the methods built on it),
and implements ``compute_advantages`` and its loss (and, if its data source differs, ``make_rollout``). Here: model
and LoRA set-up, sampling, rewards, gathering across processes, the update loop with gradient accumulation over the
method's loss terms, EMA, logging, evaluation. Around it the engine (``trl_flow/engine/``): the training loop with
the final save and push, checkpoints, export.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import time
from collections import defaultdict

import torch

from .. import editing
from ..data import check_prompt_dataset, prompt_indices
from ..kernels import gaussian_kl, kernel_mean_std
from ..models import get_adapter, index_embeds
from ..rewards import compute_rewards, validate_reward_funcs
from ..rewards.scheduling import OverlappedScoring, collect_scores
from ..rollout import Rollout, fill_prefix, sample_shared_prefix, sample_trajectories, step_samplers
from ..engine import checkpoints, distributed, guards, model_setup, prompt_encoding, stored_embeds, throughput
from ..engine import tracking, train_loop
from ..engine import output_dir as run_dir
from ..engine import callbacks as callbacks_engine
from . import trl_compat
from .base_config import FlowRLConfig
from ..engine.checkpoints import TrainerState
from ..engine.throughput import count_forwards
from ..storage import LORA_WEIGHT_NAME  # noqa: F401  (re-exported)


class UpdateLog:
    """What the update loop logs: sums and counts of each statistic, and the extremes a layer keeps."""

    def __init__(self):
        self.sums: dict[str, float] = defaultdict(float)
        self.counts: dict[str, float] = defaultdict(float)
        self.extremes: dict[str, float] = {}

    def add(self, name: str, total: float, count: float = 1) -> None:
        self.sums[name] += total
        self.counts[name] += count

    def keep(self, name: str, value: float, pick=max, start: float | None = None) -> None:
        """``extremes[name] = pick(extremes[name] (or start), value)``."""
        self.extremes[name] = pick(self.extremes.get(name, value if start is None else start), value)

    def means(self) -> dict[str, float]:
        return {name: self.sums[name] / max(self.counts[name], 1) for name in self.counts}


class FlowRLTrainer:
    """Base of every trl_flow trainer. Subclasses set ``config_class`` and ``_method_name`` and implement
    :meth:`compute_advantages` and :meth:`compute_loss`."""

    config_class = FlowRLConfig
    _method_name = "flow_rl"
    #: Keep the rollout's velocities (``Rollout.velocities``); a method that needs them sets this.
    keep_velocities = False
    #: What the rollout keeps (:data:`trl_flow.rollout.ROLLOUT_STORES`): every state and kernel mean
    #: (``"trajectory"``), or the final samples alone (``"final"``, DiffusionNFT).
    rollout_store = "trajectory"
    #: The hooks the layer's batched :meth:`term_losses` (``batch_replay_steps``) stands in for: a subclass that
    #: overrides one of them without its own ``term_losses`` is refused the field rather than silently bypassed.
    batched_term_hooks: tuple[str, ...] = ()

    #: Keep the rollout's trajectory tensors in CPU memory (a method whose config asks for it sets this).
    offload_rollout = False

    def stored_steps(self, step_kinds: list[str]) -> list[int] | None:
        """With ``rollout_store = "trained"``: the steps whose transitions the rollout keeps (see
        :func:`~trl_flow.rollout.sample_trajectories`)."""
        return None

    # ------------------------------------------------------------------------------------------------ set-up
    def __init__(self, config=None, pipe=None, reward_funcs=None, train_dataset=None, eval_dataset=None, *,
                 model=None, args=None, peft_config=None, callbacks=None, **kwargs):
        # Our form (config, pipe, reward_funcs) or TRL's (model=, reward_funcs=, args=, peft_config=): trl_compat.py.
        # Also applies peft_config and the model's own sampling settings to a copy of the config.
        config, pipe, reward_funcs = trl_compat.resolve_init_args(
            self, config, pipe, reward_funcs, model=model, args=args, peft_config=peft_config, kwargs=kwargs)
        self.config = config
        self._check_batch_replay_steps()
        run_dir.check_writable(config.output_dir)  # before any compute: the run's outputs must be saveable
        self.reward_funcs, self.reward_names, self.reward_weights = validate_reward_funcs(
            reward_funcs, config.reward_weights
        )
        if train_dataset is None:
            raise ValueError("train_dataset: required; pass a datasets.Dataset with a `prompt` column")
        self.train_dataset = check_prompt_dataset(train_dataset, "train_dataset")
        self.eval_dataset = check_prompt_dataset(eval_dataset, "eval_dataset") if eval_dataset is not None else None
        if config.eval_steps and self.eval_dataset is None:
            raise ValueError("eval_steps > 0 needs an eval_dataset; pass one or set eval_steps=0")
        self.adapter = get_adapter(pipe)  # a pipeline, or an adapter built with options (e.g. FluxAdapter(pipe, ...))
        for name, default, who in (("experts", "all", "Wan2.2-A14B's two experts"),  # fields one family reads
                                   ("guidance_scale_2", None, "Wan2.2-A14B's two experts"),
                                   ("source_image_size", "auto", "editing pipelines")):
            if getattr(config, name) != default and name not in self.adapter.reads_config_fields:
                raise ValueError(f"{name}={getattr(config, name)!r}: {type(self.adapter).__name__} does not read it "
                                 f"(only {who} do); remove it or set it to {default!r}")
        self.adapter.configure(config)
        for ds, ds_name in ((self.train_dataset, "train_dataset"), (self.eval_dataset, "eval_dataset")):
            editing.check_dataset_for(self.adapter, ds, ds_name)  # source images (editing) or none: see editing.py
        self.pipe = self.adapter.pipe
        model_setup.check_no_adapters(self)
        factor = self.adapter.resolution_multiple
        if config.height % factor or config.width % factor:
            raise ValueError(
                f"height={config.height}, width={config.width}: must be multiples of {factor} "
                "(VAE scale factor x transformer patch size) for this pipeline"
            )
        self.adapter.check_size(config.height, config.width)
        self._check_eval_size(factor)
        self.accelerator = distributed.make_accelerator(  # what the launch asked for, or an error
            config, find_unused_parameters=self.adapter.partial_forward)
        guards.check_launch(self.accelerator)
        guards.check_batch(config, self.accelerator.num_processes)
        if config.push_to_hub:  # fail now, not after training, when the Hub cannot be reached
            from ..hub import check_hub_access

            check_hub_access(self.accelerator)
        self._stored_embeds = None  # rows of datasets made by precompute_prompt_embeds: engine/stored_embeds.py
        self.train_dataset = stored_embeds.take_stored(self, self.train_dataset, "train_dataset",
                                                       config.guidance_scale)
        self.eval_dataset = stored_embeds.take_stored(self, self.eval_dataset, "eval_dataset", self._eval_guidance())
        self.state = TrainerState()
        self.state.distributed = distributed.describe(self.accelerator)
        distributed.check_trainer(self)
        self._check_rewards()
        try:
            self._setup_model()
        except BaseException:
            model_setup.remove_adapters(self)  # the pipeline stays usable for another trainer
            raise
        self._nonfinite_skipped = 0
        self._flops_per_row = None  # measured on the first iteration: engine/throughput.py
        self._peak_tflops = throughput.device_peak_tflops(self.device, config.peak_tflops)
        self._embed_cache = {} if config.cache_prompt_embeds else None
        self._long_prompts = guards.LongPromptWarning(self.adapter, config.max_sequence_length,
                                                      {"train_dataset": self.train_dataset,
                                                       "eval_dataset": self.eval_dataset})
        self._no_reward = guards.NoRewardMonitor()
        callbacks_engine.attach(self, callbacks)  # transformers' TrainerCallbacks; fires on_init_end

    def _check_batch_replay_steps(self) -> None:
        """``batch_replay_steps=True`` needs a layer whose :meth:`term_losses` batches the terms, and no subclass
        override of a hook that batched path bypasses."""
        if not self.config.batch_replay_steps:
            return
        mro = type(self).__mro__
        owner = next(c for c in mro if "term_losses" in vars(c))
        name = type(self).__name__
        if owner is FlowRLTrainer:
            raise ValueError(f"batch_replay_steps=True: {name} computes its loss terms one by one (no batched "
                             "term_losses); set batch_replay_steps=False")
        for cls in mro[:mro.index(owner)]:
            for hook in owner.batched_term_hooks:
                if hook in vars(cls):
                    raise ValueError(f"batch_replay_steps=True: {cls.__name__} overrides {hook}, which the batched "
                                     f"path of {owner.__name__}.term_losses bypasses; set batch_replay_steps=False "
                                     "or override term_losses too")

    @property
    def eval_size(self) -> tuple[int, int]:
        """(height, width) of evaluation and :meth:`generate`: ``eval_height`` / ``eval_width``, default the
        training size."""
        cfg = self.config
        return (cfg.eval_height if cfg.eval_height is not None else cfg.height,
                cfg.eval_width if cfg.eval_width is not None else cfg.width)

    def _check_eval_size(self, factor: int) -> None:
        height, width = self.eval_size
        if (height, width) == (self.config.height, self.config.width):
            return
        if self.adapter.conditioning != "text":
            raise ValueError(f"eval_height={self.config.eval_height}, eval_width={self.config.eval_width}: "
                             f"{type(self.adapter).__name__} sizes its source-image conditioning for height x width; "
                             "leave both None")
        if height % factor or width % factor:
            raise ValueError(f"eval_height={height}, eval_width={width}: must be multiples of {factor} (VAE scale "
                             "factor x transformer patch size) for this pipeline; set eval_height / eval_width to "
                             "multiples of it, or None (the training size)")
        try:
            self.adapter.check_size(height, width)
        except ValueError as e:
            raise ValueError(f"eval_height={height}, eval_width={width}: {e}") from None

    @property
    def logprob_reduction(self) -> str:
        """How a kernel's per-dimension log-density is reduced (the rollout's stored log-probs, the KL metric):
        ``mean`` here; the policy-gradient layer's ``logprob_reduction`` field."""
        return "mean"

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    def _check_rewards(self):
        """Call every reward once on two grey images (videos: (2, F, 3, H, W)) before any model compute: a reward
        that raises or returns the wrong length fails here, naming itself."""
        rows = self.train_dataset[: min(2, len(self.train_dataset))]
        prompts = rows.pop("prompt")
        images = torch.full((len(prompts), *self.adapter.output_shape(self.config.height, self.config.width)), 0.5)
        dtype = torch.bfloat16 if self.config.bf16 else torch.float16 if self.config.fp16 else torch.float32
        for f in self.reward_funcs:  # reward models run on the trainer's device and dtype unless told otherwise
            if callable(getattr(f, "prepare", None)):
                f.prepare(self.device, dtype)
        rows = editing.reward_columns(self.adapter, rows, self.config.height, self.config.width)
        compute_rewards(self.reward_funcs, self.reward_names, self.reward_weights, images, prompts, rows)

    def _setup_model(self):
        """Dtypes, LoRA (or full weights), reference, optimizer, LR schedule, EMA: :func:`.model_setup.setup_model`
        builds them; the trainer holds them."""
        hooks = checkpoints.lora_state_hooks(self) if self.config.finetune == "lora" else (None, None)
        state = model_setup.setup_model(self.config, self.accelerator, self.adapter, hooks)
        self.model, self.optimizer, self.lr_scheduler, self.ema = (state.model, state.optimizer, state.lr_scheduler,
                                                                   state.ema)
        self.ref_model, self.trainable_params = state.ref_model, state.trainable_params
        self.weight_dtype, self.offloader = state.weight_dtype, state.offloader
        self.optimizer_steps_per_iteration = state.optimizer_steps_per_iteration

    # -------------------------------------------------------------------------------------------- randomness
    def _generator(self, step: int, purpose: str, per_process: bool = False, device="cpu") -> torch.Generator:
        """A fresh generator for one purpose of one iteration, derived from (seed, step, purpose[, process])."""
        rank = self.accelerator.process_index if per_process else -1
        key = f"{self.config.seed}/{step}/{purpose}/{rank}".encode()
        seed = int.from_bytes(hashlib.sha256(key).digest()[:7], "little")
        return torch.Generator(device=device).manual_seed(seed)

    # ---------------------------------------------------------------------------------------------- rollout
    def _local_slice(self, n_global: int) -> slice:
        n = n_global // self.accelerator.num_processes
        r = self.accelerator.process_index
        return slice(r * n, (r + 1) * n)

    def _step_kinds(self, step: int) -> list[str]:
        cfg = self.config
        K = cfg.num_inference_steps
        sde = None
        if cfg.sde_window_size:
            rng = cfg.sde_window_range if cfg.sde_window_range is not None else max(1, K // 2)
            sde = torch.zeros(K, dtype=torch.bool)
            if cfg.sde_steps_mode == "random":  # k distinct steps in [0, rng) (UniRL's AllSDEScheduler)
                sde[torch.randperm(rng, generator=self._generator(step, "sde_steps"))[: cfg.sde_window_size]] = True
            else:
                start = int(torch.randint(0, rng, (1,), generator=self._generator(step, "window")))
                sde[start : start + cfg.sde_window_size] = True
        frozen = self.adapter.trainable_steps(self.adapter.schedule(K, cfg.height, cfg.width))
        if frozen is not None:  # steps of a frozen model (Wan2.2's untrained expert): deterministic, never trained
            sde = frozen if sde is None else sde & frozen
        return step_samplers(cfg.sampler, K, sde)

    def _autocast(self):
        return self.accelerator.autocast() if self.weight_dtype != torch.float32 else contextlib.nullcontext()

    @torch.no_grad()
    def encode(self, prompts: list[str], guidance_scale: float, columns: dict | None = None):
        """Prompt embeddings (each tensor (N, ...)) of N samples: each distinct prompt (and source image) encoded
        once, bit for bit as in chunks of ``per_device_train_batch_size`` samples (the sampling chunks: a prompt's
        embedding does not depend on how many prompts this process holds); see :mod:`.prompt_encoding`. An editing
        adapter (``conditioning="text_and_image"``) also gets the decoded source images from ``columns``."""
        self._long_prompts.check(prompts)
        with self._autocast(), self.offloader.use("text_encoder"), self._long_prompts.silence_pipeline():
            return prompt_encoding.encode_samples(self.adapter, prompts, columns, guidance_scale > 1,
                                                  self.config.max_sequence_length,
                                                  self.config.per_device_train_batch_size,
                                                  cache=self._embed_cache, device=self.device,
                                                  stored=self._stored_embeds)

    def sample_prompts(self, step: int) -> tuple[list[str], dict[str, list], torch.Tensor]:
        """This iteration's samples on this process: prompts, other columns and global group ids (each of N)."""
        cfg = self.config
        idx = prompt_indices(len(self.train_dataset), cfg.prompts_per_step, step, cfg.seed)
        rows = self.train_dataset[idx]
        group_ids = self.sample_layout(step)
        sl = self._local_slice(len(group_ids))
        g_local = group_ids[sl]
        prompts = [rows["prompt"][g] for g in g_local.tolist()]
        columns = {k: [v[g] for g in g_local.tolist()] for k, v in rows.items() if k != "prompt"}
        return prompts, columns, g_local

    def sample_layout(self, step: int) -> torch.Tensor:
        """The group (prompt) of each sample slot of the iteration over all processes, (P * G,). ``batch_layout``:
        ``mixed`` orders the slots by a permutation seeded by (seed, step), so each sampling chunk, and so each
        update microbatch of the first pass (which keeps the rollout's composition), holds several prompts;
        ``by_prompt`` lays them out prompt by prompt."""
        cfg = self.config
        group_ids = torch.arange(cfg.prompts_per_step).repeat_interleave(cfg.num_generations)
        if cfg.batch_layout == "mixed":
            group_ids = group_ids[torch.randperm(len(group_ids), generator=self._generator(step, "layout"))]
        return group_ids

    def sample(self, prompts, columns, group_ids, step, noise=None, start_states=None, start_step=0,
               generator_purpose: str = "sde", sample_ids=None) -> Rollout:
        """Sample one trajectory per entry of ``prompts`` with the configured kernel and store it.

        ``noise``: (N, *L) initial states (default: :meth:`initial_noise`). ``start_states`` (N, *L) at
        ``start_step``: continue stored trajectories from there instead (the earlier states/log-probs of the
        returned rollout are zeros, for the caller to fill). With ``shared_prefix`` (and no ``start_states``) the
        deterministic steps before the first stochastic one run once per group and each sample continues from its
        group's state (:func:`~trl_flow.rollout.sample_shared_prefix`). ``sample_ids`` (N,): the samples' indices
        in the iteration over all processes (default: this process's slice), which seed their SDE noise."""
        cfg = self.config
        K = cfg.num_inference_steps
        embeds = self.encode(prompts, cfg.guidance_scale, columns)
        schedule = self.adapter.schedule(K, cfg.height, cfg.width)
        if noise is None and start_states is None:
            noise = self.initial_noise(step)
        kinds = self._step_kinds(step)
        self.model.eval()
        scoring = None if not cfg.reward_num_workers else OverlappedScoring(
            cfg.reward_num_workers, self.decode, self.reward, prompts, columns, self.device)
        common = dict(noise_level=cfg.noise_level, guidance_scale=cfg.guidance_scale,
                      logprob_reduction=self.logprob_reduction, autocast=self._autocast,
                      keep_velocities=self.keep_velocities)
        prefix = None
        if cfg.shared_prefix and start_states is None:  # the ODE steps before the branch: once per group
            noise = noise.to(self.device)
            prefix = sample_shared_prefix(self.adapter, self.model, embeds, noise, group_ids, schedule, kinds,
                                          cfg.per_device_train_batch_size, **common)
            if prefix is not None:
                start_states, start_step = prefix["states"][prefix["inverse"], prefix["step"]], prefix["step"]
        traj = sample_trajectories(
            self.adapter, self.model, embeds, None if noise is None else noise.to(self.device), schedule, kinds,
            batch_size=cfg.per_device_train_batch_size,
            generator=self.sample_generators(step, generator_purpose, sample_ids, len(prompts)),
            start_states=None if start_states is None else start_states.to(self.device), start_step=start_step,
            store=self.rollout_store, keep_steps=self.stored_steps(kinds), **common,
            on_chunk=None if scoring is None else scoring.submit,
        )
        if prefix is not None:
            fill_prefix(traj, prefix)
        stochastic = torch.tensor([k != "ode" for k in kinds], device=self.device) & (traj["stds"] > 0)
        rollout = Rollout(
            prompts=list(prompts), columns=columns, group_ids=group_ids, embeds=embeds, schedule=schedule,
            states=traj["states"], log_probs=traj["log_probs"], means=traj["means"], stds=traj["stds"],
            train_mask=stochastic[None, :].expand(len(prompts), K).clone(), velocities=traj.get("velocities"),
            state_steps=traj.get("state_steps"), mean_steps=traj.get("mean_steps"),
        )
        rollout.extras["step_kinds"] = kinds
        if self.offload_rollout:  # kept in CPU memory; the update reads each microbatch through Rollout.state
            rollout.to_storage("cpu")
        if scoring is not None:  # decoded and scored in the background; score() collects it
            rollout.extras["pending_scores"] = [scoring]
        return rollout

    def sample_generators(self, step: int, purpose: str, sample_ids=None, n: int | None = None):
        """One generator per sample for its SDE noise, seeded by (seed, step, purpose, global sample index): a
        trajectory depends neither on the number of processes nor on the batch it is sampled in."""
        if sample_ids is None:  # this process's slice of the iteration's samples
            sample_ids = torch.arange(n) + self.accelerator.process_index * n
        ids = [int(i) for i in sample_ids]
        if n is not None and len(ids) != n:
            raise ValueError(f"sample_ids: {len(ids)} ids for {n} samples")
        return [self._generator(step, f"{purpose}/{i}", device=self.device) for i in ids]

    def initial_noise(self, step: int) -> torch.Tensor:
        """This process's initial noise (N, *L); identical across process counts (drawn globally, then sliced)."""
        cfg = self.config
        return self.global_noise(step, self.sample_layout(step))[self._local_slice(cfg.train_batch_size)]

    def global_noise(self, step: int, group_ids: torch.Tensor) -> torch.Tensor:
        """Initial noise (len(group_ids), *L) for every sample slot of the iteration over all processes; with
        ``same_noise_per_group`` the slots of a group share one draw."""
        cfg = self.config
        gen = self._generator(step, "noise")
        if cfg.same_noise_per_group:
            per_group = self.adapter.initial_noise(cfg.prompts_per_step, cfg.height, cfg.width, gen)
            return per_group[group_ids]
        return self.adapter.initial_noise(len(group_ids), cfg.height, cfg.width, gen)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, batch_size: int | None = None) -> torch.Tensor:
        bs = batch_size or self.config.per_device_train_batch_size
        with self._autocast(), self.offloader.use("vae"):
            return torch.cat([self.adapter.decode(latents[i : i + bs]) for i in range(0, len(latents), bs)])

    def score(self, rollout: Rollout) -> None:
        """Decode the final states, call the rewards, and mask samples that no reward scored (with
        ``reward_num_workers``: collect what the workers decoded and scored during sampling)."""
        pending = rollout.extras.pop("pending_scores", None)
        t0 = time.perf_counter()
        if pending is not None:
            rollout.images, rollout.rewards, rollout.rewards_per_func, reward_s = collect_scores(pending, len(rollout))
            rollout.extras.setdefault("metrics", {})["time/reward_wait_s"] = time.perf_counter() - t0
        else:
            rollout.images = self.decode(rollout.states[:, -1].to(self.device))
            t0 = time.perf_counter()
            rollout.rewards, rollout.rewards_per_func = self.reward(rollout.images, rollout.prompts, rollout.columns)
            reward_s = time.perf_counter() - t0
        rollout.extras["reward_s"] = rollout.extras.get("reward_s", 0.0) + reward_s
        nan = torch.isnan(rollout.rewards).to(rollout.train_mask.device)
        rollout.train_mask &= ~nan[:, None]

    def reward(self, images, prompts, columns):
        """Every reward on ``images`` (B, 3, H, W), in calls of ``per_device_reward_batch_size`` images (default:
        all), each within ``reward_timeout`` seconds. Returns the combined (B,) rewards and each reward's (B,)."""
        bs = self.config.per_device_reward_batch_size or len(prompts)
        cfg = self.config
        parts = [compute_rewards(self.reward_funcs, self.reward_names, self.reward_weights, images[lo : lo + bs],
                                 prompts[lo : lo + bs], editing.reward_columns(
                                     self.adapter, {k: v[lo : lo + bs] for k, v in columns.items()}, cfg.height,
                                     cfg.width), timeout=cfg.reward_timeout)
                 for lo in range(0, len(prompts), max(bs, 1))]
        if len(parts) == 1:
            return parts[0]
        return torch.cat([p[0] for p in parts]), {k: torch.cat([p[1][k] for p in parts]) for k in self.reward_names}

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """Concatenate a per-process tensor over processes (in process order), on CPU."""
        if self.accelerator.num_processes == 1:
            return t.cpu()
        return self.accelerator.gather(t.to(self.device).contiguous()).cpu()

    def make_rollout(self, step: int) -> Rollout:
        """The data source: this iteration's prompts, sampled and scored. OP-GRPO overrides this."""
        prompts, columns, group_ids = self.sample_prompts(step)
        rollout = self.sample(prompts, columns, group_ids, step)
        self.score(rollout)
        return rollout

    # ------------------------------------------------------------------------------------ method interface
    def compute_advantages(self, rollout: Rollout) -> None:
        """Set ``rollout.advantages`` ((N,) or (N, K)) for this process's samples."""
        raise NotImplementedError

    # ------------------------------------------------------------------------------------------- update
    @contextlib.contextmanager
    def reference_policy(self):
        """The reference policy for the KL term: adapters disabled (LoRA) or the frozen copy (full)."""
        if self.ref_model is not None:
            yield self.ref_model
            return
        if self.config.finetune == "full":
            raise ValueError("finetune='full' keeps a frozen reference copy only when beta > 0; set beta > 0")
        model = self.accelerator.unwrap_model(self.model)
        model.disable_adapters()
        try:
            yield model
        finally:
            model.enable_adapters()

    def loss_terms(self, rollout: Rollout, idx: torch.Tensor, step: int, epoch: int, batch: int) -> list:
        """The backward passes of the microbatch ``idx`` (its ``batch``-th of pass ``epoch``): one term each, e.g. a
        trained step (policy gradient) or a training timestep (DiffusionNFT). The same number on every process."""
        raise NotImplementedError

    def term_loss(self, rollout: Rollout, idx: torch.Tensor, term) -> tuple[torch.Tensor, dict, torch.Tensor]:
        """(scalar loss, per-sample statistics {name: (B,)}, (B,) bool mask of the samples the term trains) of one
        term of :meth:`loss_terms`. Every statistic is logged as its mean over the masked samples (NaN: left out)."""
        raise NotImplementedError

    def term_batches(self, terms: list) -> list[list]:
        """The terms of a microbatch split, in order, into the batches computed together: one forward and one
        backward of their weighted sum each (:meth:`term_losses`). Default: each term alone (one backward per
        term); with ``batch_replay_steps`` the policy-gradient layer and DiffusionNFT put them all in one."""
        return [[term] for term in terms]

    def term_losses(self, rollout: Rollout, idx: torch.Tensor, terms: list) -> list[tuple]:
        """:meth:`term_loss` of each of ``terms`` (one batch of :meth:`term_batches`), in order. A layer that
        batches terms computes them here in one forward."""
        return [self.term_loss(rollout, idx, term) for term in terms]

    def record_extremes(self, log: UpdateLog, name: str, values: torch.Tensor, first: bool) -> None:
        """Further statistics of one term's statistic ``name`` (its masked, non-NaN ``values``); ``first``: the
        first optimizer step of the iteration, before any update. The policy-gradient layer keeps ratio extremes."""

    def after_microbatch(self, rollout: Rollout, idx: torch.Tensor, log: UpdateLog) -> None:
        """Called after the backward passes of a microbatch."""

    def after_optimizer_step(self) -> None:
        """Called after each optimizer step (also a skipped one)."""

    def update_metrics(self, log: UpdateLog) -> dict[str, float]:
        """The update's metrics from ``log``: means of the statistics, then what a layer adds."""
        return log.means()

    def optimize(self, rollout: Rollout, step: int) -> dict[str, float]:
        """``num_inner_epochs`` passes over the rollout; one optimizer step per ``gradient_accumulation_steps``
        microbatches, each microbatch accumulating over its :meth:`loss_terms` (one backward per batch of
        :meth:`term_batches`)."""
        cfg, acc = self.config, self.accelerator
        n = len(rollout)
        mb = cfg.per_device_train_batch_size
        log = UpdateLog()
        grad_norms, prompts_per_mb, terms_per_mb = [], [], []
        self.model.train()
        for epoch in range(cfg.num_inner_epochs):
            # Epoch 0 keeps the rollout's batch composition, so its log-probs are recomputed bit for bit.
            order = (torch.arange(n) if epoch == 0
                     else torch.randperm(n, generator=self._generator(step, f"shuffle{epoch}", per_process=True)))
            batches = [order[i : i + mb].to(self.device) for i in range(0, n, mb)]
            groups = [batches[i : i + cfg.gradient_accumulation_steps]
                      for i in range(0, len(batches), cfg.gradient_accumulation_steps)]
            for g_i, group in enumerate(groups):
                if not self._any_trainable(rollout, group):
                    continue  # no sample has a reward anywhere: no forward, no optimizer step, weights untouched
                prompts_per_mb += [len(torch.unique(rollout.group_ids[idx.to(rollout.group_ids.device)]))
                                   for idx in group]
                for b_i, idx in enumerate(group):
                    terms = self.loss_terms(rollout, idx, step, epoch, g_i * len(groups[0]) + b_i)
                    terms_per_mb.append(len(terms))
                    chunks = self.term_batches(terms)
                    for t_i, chunk in enumerate(chunks):
                        last = b_i == len(group) - 1 and t_i == len(chunks) - 1
                        with contextlib.nullcontext() if last else acc.no_sync(self.model):
                            results, total = [], None
                            for loss, stats, mask in self.term_losses(rollout, idx, chunk):
                                if not torch.isfinite(loss):
                                    loss = torch.nan_to_num(loss, nan=0.0, posinf=0.0, neginf=0.0) * 0.0
                                    self._nonfinite_skipped += 1
                                results.append((loss, stats, mask))
                                total = loss if total is None else total + loss
                            # each term weighted 1 / (microbatches x terms), whether alone or batched
                            acc.backward(total / (len(group) * len(terms)))
                        for loss, stats, mask in results:
                            for name, val in stats.items():
                                sel = val.detach()[mask]
                                sel = sel[~torch.isnan(sel)]  # NaN marks "not part of this statistic"
                                self.record_extremes(log, name, sel, first=epoch == 0 and g_i == 0)
                                log.add(name, float(sel.sum()), sel.numel())
                            log.add("loss", float(loss.detach()))
                    self.after_microbatch(rollout, idx, log)
                grad_norms.append(self._optimizer_step())
                self.after_optimizer_step()
        metrics = self.update_metrics(log)
        metrics["prompts_per_microbatch"] = sum(prompts_per_mb) / len(prompts_per_mb) if prompts_per_mb else 0.0
        metrics["trained_steps"] = sum(terms_per_mb) / len(terms_per_mb) if terms_per_mb else 0.0  # per microbatch
        finite = [g for g in grad_norms if math.isfinite(g)]
        metrics["grad_norm"] = sum(finite) / len(finite) if finite else float("nan")
        metrics["nonfinite_skipped"] = self._nonfinite_skipped
        metrics["learning_rate"] = self.lr_scheduler.get_last_lr()[0]
        return metrics

    def _any_trainable(self, rollout: Rollout, group: list[torch.Tensor]) -> bool:
        """Whether any process has a trainable (sample, step) in this accumulation group (processes agree)."""
        flag = torch.tensor([float(bool(rollout.train_mask[torch.cat(group)].any()))], device=self.device)
        if self.accelerator.num_processes > 1:
            flag = self.accelerator.reduce(flag, reduction="sum")
        return bool(flag.item() > 0)

    def _optimizer_step(self) -> float:
        """Clip, check, step. A non-finite gradient skips the step: weights, optimizer and EMA stay untouched."""
        cfg, acc = self.config, self.accelerator
        if cfg.max_grad_norm > 0:
            norm = acc.clip_grad_norm_(self.trainable_params, cfg.max_grad_norm)
        else:
            norm = torch.linalg.vector_norm(
                torch.stack([p.grad.detach().float().norm() for p in self.trainable_params if p.grad is not None]))
        norm = float(norm)
        if not math.isfinite(norm):
            self.optimizer.zero_grad(set_to_none=True)
            self._nonfinite_skipped += 1
            return norm
        self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.ema is not None:
            self.ema.step(self.trainable_params)
        return norm

    # --------------------------------------------------------------------------------------------- loop
    def train(self, resume_from_checkpoint: str | bool | None = None):
        """Run ``max_steps`` iterations, then save the final model into ``output_dir`` (and push it when
        ``push_to_hub``). ``resume_from_checkpoint``: a checkpoint folder, or True / "latest" for the newest
        ``checkpoint-*`` in ``output_dir``. Returns the trainer state. The loop: :mod:`~trl_flow.engine.train_loop`."""
        return train_loop.train(self, resume_from_checkpoint)

    def training_iteration(self, step: int) -> dict[str, float]:
        """One iteration: rollout (with rewards), advantages, update. Returns its metrics."""
        with count_forwards(self.pipe, self.adapter.trained_components()) as calls:
            t0 = time.perf_counter()
            rollout = self.make_rollout(step)
            t1 = time.perf_counter()
            rollout_calls = dict(calls)
            self.compute_advantages(rollout)
            metrics = self.optimize(rollout, step)
            t2 = time.perf_counter()
        if self._flops_per_row is None:
            self._flops_per_row = self._probe_flops(rollout)
        grad_rows = calls["transformer_rows_grad"]
        metrics.update(throughput.metrics(self._flops_per_row, grad_rows, calls["transformer_rows"] - grad_rows,
                                          t2 - t0, self._peak_tflops))
        metrics.update(self.rollout_metrics(rollout))
        metrics.update({"time/rollout_s": t1 - t0, "time/update_s": t2 - t1})
        n = len(rollout)  # this process's samples
        metrics.update({"throughput/rollout_images_per_s": n / max(t1 - t0, 1e-9),
                        "throughput/update_images_per_s": n / max(t2 - t1, 1e-9),
                        "throughput/iteration_images_per_s": n / max(t2 - t0, 1e-9),
                        "calls/rollout_transformer": rollout_calls["transformer"],
                        "calls/update_transformer": calls["transformer"] - rollout_calls["transformer"],
                        "rows/rollout_transformer": rollout_calls["transformer_rows"],
                        "rows/update_transformer": calls["transformer_rows"] - rollout_calls["transformer_rows"],
                        "calls/text_encoder": calls["text_encoder"]})
        metrics.update(rollout.extras.get("metrics", {}))
        if self.config.log_images_steps and (step + 1) % self.config.log_images_steps == 0:
            self._save_grid(rollout.images, f"train_step_{step + 1}.png")
        tracking.log_rollout(self, rollout, step + 1)
        self.last_rollout = rollout
        return metrics

    def _probe_flops(self, rollout: Rollout) -> float:
        """FLOPs of one trained-transformer forward on one latent row at the training size (one probe call, outside
        the iteration's timing and call counts): :func:`.throughput.flops_per_row`."""
        cfg = self.config
        x = self.adapter.initial_noise(1, cfg.height, cfg.width, torch.Generator().manual_seed(0)).to(self.device)
        return throughput.flops_per_row(self.adapter, self.model, x, rollout.schedule.timesteps[0],
                                        index_embeds(rollout.embeds, slice(0, 1)), self._autocast)

    def rollout_metrics(self, rollout: Rollout) -> dict[str, float]:
        rewards = self.gather(rollout.rewards)
        m = {"reward": _nanmean(rewards), "reward_std": _nanstd(rewards),
             "no_reward_frac": float(torch.isnan(rewards).float().mean())}
        for name, r in rollout.rewards_per_func.items():
            r = self.gather(r)
            m[f"rewards/{name}"] = _nanmean(r)
            m[f"rewards/{name}_none_frac"] = float(torch.isnan(r).float().mean())
        if rollout.advantages is not None:
            m["advantage_abs"] = float(self.gather(rollout.advantages.float()).abs().mean())
        m["time/reward_s"] = rollout.extras.get("reward_s", 0.0)
        return m

    def log(self, metrics: dict, step: int) -> None:
        entry = {"step": step, **{k: float(v) for k, v in metrics.items()}}
        self.state.log_history.append(entry)
        if self.config.report_to:
            self.accelerator.log(tracking.tracker_metrics(entry), step=step)  # train/..., eval/... as TRL
        if self.accelerator.is_main_process:
            os.makedirs(self.config.output_dir, exist_ok=True)
            run_dir.write_log(os.path.join(self.config.output_dir, run_dir.LOG_NAME), [entry])

    # ----------------------------------------------------------------------------------------- evaluation
    @contextlib.contextmanager
    def ema_weights(self):
        """Swap the EMA weights in (if EMA is on) for evaluation or saving."""
        if self.ema is None:
            yield
            return
        self.ema.store(self.trainable_params)
        self.ema.copy_to(self.trainable_params)
        try:
            yield
        finally:
            self.ema.restore(self.trainable_params)

    @torch.no_grad()
    def _ode_trajectories(self, prompts: list[str], seed: int, num_inference_steps: int, guidance_scale: float,
                          columns: dict | None = None, model=None, size: tuple[int, int] | None = None):
        """Deterministic trajectories of the current policy (or of ``model``) from noise seeded by ``seed``, at
        ``size`` (height, width; default the training size)."""
        cfg = self.config
        height, width = size if size is not None else (cfg.height, cfg.width)
        noise = self.adapter.initial_noise(len(prompts), height, width, torch.Generator().manual_seed(seed))
        embeds = self.encode(prompts, guidance_scale, columns)
        schedule = self.adapter.schedule(num_inference_steps, height, width)
        model = self.model if model is None else model
        model.eval()
        traj = sample_trajectories(self.adapter, model, embeds, noise.to(self.device), schedule,
                                   ["ode"] * num_inference_steps, 0.0, guidance_scale,
                                   cfg.per_device_eval_batch_size, autocast=self._autocast)
        return traj["states"], embeds, schedule

    @torch.no_grad()
    def generate(self, prompts: list[str], seed: int = 0, num_inference_steps: int | None = None,
                 guidance_scale: float | None = None, columns: dict | None = None,
                 model=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Deterministic (ODE) samples of the current policy: images (B, 3, H, W) in [0, 1] and latents, at
        :attr:`eval_size` (``eval_height`` x ``eval_width``, default the training size).
        ``columns``: the prompts' dataset columns (an editing pipeline reads its source images there). ``model``:
        another network to sample with (the frozen reference copy), default the trained one."""
        cfg = self.config
        K = num_inference_steps or cfg.eval_num_inference_steps
        gs = guidance_scale if guidance_scale is not None else self._eval_guidance()
        states, _, _ = self._ode_trajectories(prompts, seed, K, gs, columns, model=model, size=self.eval_size)
        latents = states[:, -1]
        return self.decode(latents, cfg.per_device_eval_batch_size), latents

    def _eval_guidance(self) -> float:
        cfg = self.config
        return cfg.eval_guidance_scale if cfg.eval_guidance_scale is not None else cfg.guidance_scale

    @torch.no_grad()
    def kl_to_reference(self, prompts: list[str], seed: int = 0, sampler: str | None = None,
                        noise_level: float | None = None, columns: dict | None = None) -> torch.Tensor:
        """Exact KL of a transition kernel to the reference policy's, along the policy's ODE trajectories.

        For each prompt, the policy's deterministic trajectory over the training schedule
        (``num_inference_steps``) is sampled with noise seeded by ``seed``; at every stochastic step ``k`` the
        kernels of the policy and of the reference (adapters disabled / frozen copy) at ``x_k`` are compared with
        :func:`~trl_flow.kernels.gaussian_kl` (:attr:`logprob_reduction`). The kernel is the training one unless
        ``sampler`` / ``noise_level`` name another: pass the same for every method to compare methods trained with
        different kernels (a ``ddim`` kernel's tiny early stds make its KL much larger than ``flow_sde``'s for the
        same change of velocity). Returns (B,) KLs summed over the steps.
        """
        cfg = self.config
        K = cfg.num_inference_steps
        noise_level = cfg.noise_level if noise_level is None else noise_level
        kinds = step_samplers(sampler or cfg.sampler, K, None)
        states, embeds, schedule = self._ode_trajectories(prompts, seed, K, cfg.guidance_scale, columns)
        sig = schedule.sigmas
        total = torch.zeros(len(prompts))
        bs = cfg.per_device_eval_batch_size
        for lo in range(0, len(prompts), bs):
            idx = slice(lo, lo + bs)
            emb = index_embeds(embeds, idx)
            for k, kind in enumerate(kinds):
                if kind == "ode":
                    continue
                x = states[idx, k]
                with self._autocast():
                    v = self.adapter.velocity(self.model, x, schedule.timesteps[k], emb, cfg.guidance_scale)
                with self.reference_policy() as ref, self._autocast():
                    v_ref = self.adapter.velocity(ref, x, schedule.timesteps[k], emb, cfg.guidance_scale)
                mu, std = kernel_mean_std(kind, x, v, sig[k], sig[k + 1], noise_level)
                mu_ref, _ = kernel_mean_std(kind, x, v_ref, sig[k], sig[k + 1], noise_level)
                total[idx] += gaussian_kl(mu, mu_ref, std, self.logprob_reduction).cpu()
        return total

    @torch.no_grad()
    def evaluate(self, eval_dataset=None) -> dict[str, float]:
        """ODE samples (``eval_num_inference_steps``) of the eval prompts with a fixed noise seed, scored by every
        reward. Returns ``eval/reward`` and ``eval/<reward name>``; saves a grid to output_dir/samples."""
        ds = check_prompt_dataset(eval_dataset, "eval_dataset") if eval_dataset is not None else self.eval_dataset
        if eval_dataset is not None:
            editing.check_dataset_for(self.adapter, ds, "eval_dataset")
            ds = stored_embeds.take_stored(self, ds, "eval_dataset", self._eval_guidance())
        if ds is None:
            raise ValueError("evaluate: no eval_dataset; pass one to the trainer or to evaluate()")
        acc = self.accelerator
        rows = ds[:]
        prompts = rows.pop("prompt")
        n = len(prompts)
        per = math.ceil(n / acc.num_processes)
        lo, hi = acc.process_index * per, min(n, (acc.process_index + 1) * per)
        with self.ema_weights():
            gen_seed = self.config.seed + 10_007 * (acc.process_index + 1)
            images, _ = self.generate(prompts[lo:hi], seed=gen_seed, columns={k: v[lo:hi] for k, v in rows.items()}
                                      ) if hi > lo else (None, None)
        if hi > lo:
            total, per_func = self.reward(images, prompts[lo:hi], {k: v[lo:hi] for k, v in rows.items()})
        else:
            total, per_func = torch.zeros(0), {k: torch.zeros(0) for k in self.reward_names}
        all_total = _gather_object(acc, total)
        all_per_func = {name: _gather_object(acc, r) for name, r in per_func.items()}
        m = {"eval/reward": _nanmean(all_total), **{f"eval/{n}": _nanmean(r) for n, r in all_per_func.items()}}
        if images is not None:
            self._save_grid(images[:64], f"eval_step_{self.state.global_step}.png")
        tracking.log_eval(self, images, prompts[lo:hi], total, per_func, all_total, all_per_func,
                          self.state.global_step)
        self.last_eval_images = images
        return m

    def _save_grid(self, images: torch.Tensor, filename: str) -> None:
        if not self.accelerator.is_main_process or images is None or not len(images):
            return
        if images.ndim == 5:  # videos (B, F, 3, H, W): one frame strip per row, and a GIF/MP4 of each
            from ..video import save_videos

            save_videos(images[:8], os.path.join(self.config.output_dir, "samples"), filename)
            return
        out = os.path.join(self.config.output_dir, "samples")
        os.makedirs(out, exist_ok=True)
        tracking.grid(images[:64]).save(os.path.join(out, filename))

    # ---------------------------------------------------------------------------------------- checkpoints
    def save_checkpoint(self) -> str:
        """Write ``output_dir/checkpoint-<step>`` kill-safely (see :mod:`~trl_flow.engine.checkpoints`);
        rotated by ``save_total_limit`` among this run's checkpoints."""
        return checkpoints.save_checkpoint(self)

    def load_checkpoint(self, path: str | bool) -> None:
        """Resume from a checkpoint folder, or True / "latest" for the newest complete one in ``output_dir``."""
        checkpoints.load_checkpoint(self, path)

    def save_extra_state(self, path: str) -> None:
        """Method-specific state to save with a checkpoint (OP-GRPO: the replay buffer)."""

    def load_extra_state(self, path: str) -> None:
        """Restore what :meth:`save_extra_state` wrote."""

    def check_saved_config(self, saved: dict, source: str) -> None:
        """On resume, before anything is loaded: refuse a checkpoint whose saved config (``saved``, read from the file
        ``source``) this method cannot continue (OP-GRPO: one of its former replay semantics)."""

    # ------------------------------------------------------------------------------------- export, hub
    def save_model(self, output_dir: str | None = None) -> str:
        """Write the trained weights in diffusers format (EMA weights if EMA is on), atomically: a failure or an
        interrupt leaves ``output_dir`` as it was (:class:`~trl_flow.storage.SaveError` names the folder
        and the disk; the weights stay in memory for another try). ``train()`` already saves into ``output_dir``.

        LoRA: ``pytorch_lora_weights.safetensors`` via the pipeline's ``save_lora_weights``, with the adapter
        metadata (so ``lora_alpha != r`` round-trips): ``pipe.load_lora_weights(output_dir)`` works.
        Full fine-tuning: the whole pipeline via ``save_pretrained``.
        Under FSDP every process gathers the sharded weights and the main process writes the same files.
        """
        return train_loop.save_model(self, output_dir)

    def push_to_hub(self, commit_message: str = "End of training", private: bool | None = None,
                    include_replay_buffer: bool | None = None) -> str:
        """Save the model (unless ``train()`` did), then upload it to ``hub_model_id`` with a model card; a failed
        upload says where the model is and how to push it later: see :func:`trl_flow.hub.push_to_hub`."""
        from ..hub import push_to_hub

        return push_to_hub(self, commit_message=commit_message, private=private,
                           include_replay_buffer=include_replay_buffer)

    paper = ""


def _nanmean(t: torch.Tensor) -> float:
    return float(torch.nanmean(t.float()))


def _nanstd(t: torch.Tensor) -> float:
    t = t.float()
    ok = ~torch.isnan(t)
    return float(t[ok].std(unbiased=False)) if ok.sum() > 1 else 0.0


def _gather_object(acc, t: torch.Tensor) -> torch.Tensor:
    if acc.num_processes == 1:
        return t
    from accelerate.utils import gather_object

    return torch.tensor(gather_object(t.tolist()))
