"""Adapter for ``LTX2Pipeline`` (LTX-2: text to video with audio, denoised together)."""

from __future__ import annotations

import math

import numpy as np
import torch

from .base import FlowAdapter, PromptEmbeds, Schedule
from .wan import _check_num_frames

#: ``LTX2Pipeline.__call__``'s guidance defaults (diffusers 0.42.1), the adapter's option defaults.
PIPELINE_GUIDANCE = dict(stg_scale=1.0, modality_scale=3.0, guidance_rescale=0.7, audio_guidance_scale=7.0,
                         audio_stg_scale=1.0, audio_modality_scale=3.0, audio_guidance_rescale=0.7,
                         spatio_temporal_guidance_blocks=(28,))


class LTX2Adapter(FlowAdapter):
    """LTX-2: Gemma 3 conditioning through the pipeline's text connectors, ``LTX2VideoTransformer3DModel`` (one
    transformer denoising video and audio together, with audio-video cross-attention), the video and audio VAEs.

    * **The audio branch is sampled and trained, not rewarded.** The transformer cannot run without its audio
      latents, so a sample's state is both, as the pipeline packs them: the video tokens (F' h w, C) and the audio
      tokens (L, C_a M), flattened and concatenated into one vector (``latent_shape`` = (F' h w C + L C_a M,)). Both
      follow the same schedule and kernel, so the log-probs, the KL and the LoRA cover the audio as well; the
      rewards receive the decoded video (B, F, 3, H, W) only. :meth:`decode_audio` gives the waveform
      (``pipe()``'s ``audio``) for a reward or a check that needs it; :meth:`split` the two latents.
    * Guidance is the pipeline's, step by step, in x0 space: CFG (the trainer's ``guidance_scale`` for the video,
      ``audio_guidance_scale`` for the audio; one batched pass over [negative, prompt] when either is above 1),
      spatio-temporal guidance (a pass with the ``spatio_temporal_guidance_blocks`` perturbed, when ``stg_scale`` or
      ``audio_stg_scale`` > 0), modality isolation (a pass without audio-video cross-attention, when
      ``modality_scale`` or ``audio_modality_scale`` > 1), summed as deltas, rescaled (``guidance_rescale``) and
      converted back to a velocity with the step's sigma. The options default to the pipeline's call defaults
      (``PIPELINE_GUIDANCE``): up to three transformer passes per step. With two or more guidance passes the
      velocity's ``detach_uncond`` detaches every guidance-only prediction.
    * Prompts: ``pipe.encode_prompt`` (Gemma 3's hidden states of every layer, left-padded to
      ``max_sequence_length``) through ``pipe.connectors`` (run on [negative, prompt] together, as ``pipe()`` does),
      stored as the connectors' video and audio embeddings and mask.
    * Sigmas: ``linspace(1, 1 / K, K)`` shifted by ``calculate_shift(video tokens)`` with the pipeline's LTX-2
      defaults; the transformer takes the scheduler's timesteps (and ``sigma=timestep``) as they are.
    * ``num_frames`` from the trainer config (a multiple of the VAE's temporal factor, plus 1); ``frame_rate``
      (default 24, the pipeline's) sets the audio length and the video's positional frame rate.
    * Refused: a VAE with ``timestep_conditioning`` (decoding then draws noise), ``noise_scale`` (not an option).
    """

    #: The attention projections of every attention (video and audio self-attention, text and audio-video
    #: cross-attention): diffusers' LTX-2 LoRA targets.
    default_lora_target_modules = ("to_q", "to_k", "to_v", "to_out.0")
    pipeline_tag = "text-to-video"

    def __init__(self, pipe, num_frames: int = 121, negative_prompt: str = "", frame_rate: float = 24.0,
                 stg_scale: float = PIPELINE_GUIDANCE["stg_scale"],
                 modality_scale: float = PIPELINE_GUIDANCE["modality_scale"],
                 guidance_rescale: float = PIPELINE_GUIDANCE["guidance_rescale"],
                 audio_guidance_scale: float = PIPELINE_GUIDANCE["audio_guidance_scale"],
                 audio_stg_scale: float = PIPELINE_GUIDANCE["audio_stg_scale"],
                 audio_modality_scale: float = PIPELINE_GUIDANCE["audio_modality_scale"],
                 audio_guidance_rescale: float = PIPELINE_GUIDANCE["audio_guidance_rescale"],
                 spatio_temporal_guidance_blocks=PIPELINE_GUIDANCE["spatio_temporal_guidance_blocks"],
                 use_cross_timestep: bool = True):
        super().__init__(pipe)
        if pipe.transformer is None or pipe.audio_vae is None:
            raise ValueError("pipe: the LTX2Pipeline needs its transformer and audio_vae (the audio latents are "
                             "denoised with the video)")
        if pipe.vae.config.get("timestep_conditioning", False):
            raise ValueError("pipe.vae: timestep_conditioning=True (its decode mixes in generator noise) is not "
                             "supported")
        if not isinstance(negative_prompt, str):
            raise TypeError(f"negative_prompt: a string (default ''), got {negative_prompt!r}")
        for name, value in (("frame_rate", frame_rate), ("stg_scale", stg_scale), ("modality_scale", modality_scale),
                            ("guidance_rescale", guidance_rescale), ("audio_guidance_scale", audio_guidance_scale),
                            ("audio_stg_scale", audio_stg_scale), ("audio_modality_scale", audio_modality_scale),
                            ("audio_guidance_rescale", audio_guidance_rescale)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name}={value!r}: must be a finite number >= 0")
        if frame_rate <= 0:
            raise ValueError(f"frame_rate={frame_rate!r}: must be > 0")
        blocks = list(spatio_temporal_guidance_blocks or [])
        n_layers = pipe.transformer.config.num_layers
        if (stg_scale > 0 or audio_stg_scale > 0) and not blocks:
            raise ValueError("stg_scale > 0 needs spatio_temporal_guidance_blocks (the blocks STG perturbs); pass "
                             "blocks or stg_scale=0, audio_stg_scale=0")
        if (stg_scale > 0 or audio_stg_scale > 0) and any(not isinstance(b, int) or not 0 <= b < n_layers
                                                           for b in blocks):
            raise ValueError(f"spatio_temporal_guidance_blocks={blocks}: block indices of this {n_layers}-block "
                             "transformer")
        self.num_frames = _check_num_frames(num_frames, pipe.vae_temporal_compression_ratio, family="LTX-2")
        self.negative_prompt = negative_prompt
        self.frame_rate = float(frame_rate)
        self.stg_scale, self.modality_scale, self.guidance_rescale = stg_scale, modality_scale, guidance_rescale
        self.audio_guidance_scale, self.audio_stg_scale = audio_guidance_scale, audio_stg_scale
        self.audio_modality_scale, self.audio_guidance_rescale = audio_modality_scale, audio_guidance_rescale
        self.stg_blocks = blocks
        self.use_cross_timestep = use_cross_timestep
        self._sizes = {}  # state length -> the (height, width) of every schedule built with it
        self._sigma_of = {}  # timestep -> its scheduler sigma, over every schedule built

    @property
    def pipeline_class(self):
        from diffusers import LTX2Pipeline

        return LTX2Pipeline

    @property
    def resolution_multiple(self) -> int:
        """32 (``LTX2Pipeline.check_inputs`` refuses other sizes; the real VAE compresses 32x) and the VAE x patch."""
        return math.lcm(32, self.pipe.vae_spatial_compression_ratio * self.pipe.transformer_spatial_patch_size)

    def configure(self, config) -> None:
        self.num_frames = _check_num_frames(config.num_frames, self.pipe.vae_temporal_compression_ratio,
                                            family="LTX-2")

    # ------------------------------------------------------------------------------------------- shapes
    def _dims(self, height, width) -> dict:
        """The pipeline's latent sizes (``__call__`` step 4) for this size and ``num_frames``."""
        pipe = self.pipe
        frames = (self.num_frames - 1) // pipe.vae_temporal_compression_ratio + 1
        h, w = height // pipe.vae_spatial_compression_ratio, width // pipe.vae_spatial_compression_ratio
        per_second = (pipe.audio_sampling_rate / pipe.audio_hop_length
                      / float(pipe.audio_vae_temporal_compression_ratio))
        audio_frames = round(self.num_frames / self.frame_rate * per_second)
        mel = pipe.audio_vae.config.mel_bins // pipe.audio_vae_mel_compression_ratio
        c, ca = pipe.transformer.config.in_channels, pipe.audio_vae.config.latent_channels
        return dict(frames=frames, h=h, w=w, audio_frames=audio_frames, mel=mel, c=c, ca=ca,
                    video=frames * h * w * c, audio=audio_frames * ca * mel)

    def latent_shape(self, height, width):
        d = self._dims(height, width)
        return (d["video"] + d["audio"],)

    def output_shape(self, height, width):
        return (self.num_frames, 3, height, width)

    def _size_of(self, x) -> tuple[dict, int, int]:
        """The (height, width) whose latents ``x`` holds, from the shape set by :meth:`schedule`."""
        sizes = self._sizes.get(x.shape[-1], set())
        if len(sizes) != 1:
            raise RuntimeError(f"LTX2Adapter: states of length {x.shape[-1]} " + (
                "come from no schedule: call schedule(K, height, width) for their size first" if not sizes else
                f"fit several sizes (height, width) {sorted(sizes)}: use one of them per adapter"))
        height, width = next(iter(sizes))
        return self._dims(height, width), height, width

    def split(self, x, height, width) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, D) states -> the pipeline's packed video (B, F' h w, C) and audio (B, L, C_a M) latents."""
        d = self._dims(height, width)
        return (x[:, :d["video"]].reshape(x.shape[0], -1, d["c"]),
                x[:, d["video"]:].reshape(x.shape[0], d["audio_frames"], -1))

    def initial_noise(self, n, height, width, generator) -> torch.Tensor:
        """As ``pipe()`` draws it from one generator: the video noise (n, C, F', h, w), then the audio noise
        (n, C_a, L, M), each packed as the pipeline packs them, flattened and concatenated."""
        pipe, d = self.pipe, self._dims(height, width)
        kw = dict(generator=generator, device=generator.device, dtype=torch.float32)
        video = torch.randn((n, d["c"], d["frames"], d["h"], d["w"]), **kw)
        audio = torch.randn((n, d["ca"], d["audio_frames"], d["mel"]), **kw)
        video = pipe._pack_latents(video, pipe.transformer_spatial_patch_size, pipe.transformer_temporal_patch_size)
        return torch.cat([video.flatten(1), pipe._pack_audio_latents(audio).flatten(1)], dim=1)

    # ------------------------------------------------------------------------------------------- prompts
    def encode_prompts(self, prompts, guidance, max_sequence_length=1024) -> PromptEmbeds:
        """The connectors' ``connector_prompt_embeds`` (B, S, D), ``connector_audio_prompt_embeds`` (B, S, D_a) and
        ``connector_attention_mask`` (B, S); with CFG (``guidance`` or ``audio_guidance_scale > 1``, the pipeline's
        rule) the negative prompt's too (``negative_...``)."""
        pipe = self.pipe
        prompts = list(prompts)
        cfg = guidance or self.audio_guidance_scale > 1
        pe, mask, npe, nmask = pipe.encode_prompt(
            prompt=prompts, negative_prompt=[self.negative_prompt] * len(prompts), do_classifier_free_guidance=cfg,
            max_sequence_length=max_sequence_length, device=self.device)
        if cfg:
            pe, mask = torch.cat([npe, pe]), torch.cat([nmask, mask])
        side = getattr(pipe.tokenizer, "padding_side", "left") if getattr(pipe, "tokenizer", None) else "left"
        video, audio, cmask = pipe.connectors(pe, mask, padding_side=side)
        names = ("connector_prompt_embeds", "connector_audio_prompt_embeds", "connector_attention_mask")
        if not cfg:
            return dict(zip(names, (video, audio, cmask)))
        out = {}
        for name, value in zip(names, (video, audio, cmask)):
            negative, positive = value.chunk(2)
            out[name], out[f"negative_{name}"] = positive, negative
        return out

    def prompt_token_limits(self, max_sequence_length) -> dict[str, int]:
        """The pipeline's Gemma tokenizer cuts at ``max_sequence_length`` (its ``model_max_length`` is not the
        limit)."""
        return {"tokenizer": max_sequence_length}

    def prompt_token_counts(self, prompts, name) -> list[int]:
        """Tokens with the special ones, of the stripped prompt, as the pipeline tokenizes it."""
        return [len(ids) for ids in self.pipe.tokenizer([p.strip() for p in prompts])["input_ids"]]

    # ------------------------------------------------------------------------------------------- sampling
    def schedule(self, num_inference_steps, height, width) -> Schedule:
        from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift, retrieve_timesteps

        pipe, d = self.pipe, self._dims(height, width)
        config = pipe.scheduler.config
        mu = calculate_shift(d["video"] // d["c"], config.get("base_image_seq_len", 1024),
                             config.get("max_image_seq_len", 4096), config.get("base_shift", 0.95),
                             config.get("max_shift", 2.05))
        sigmas = np.linspace(1.0, 1 / num_inference_steps, num_inference_steps)
        timesteps, _ = retrieve_timesteps(pipe.scheduler, num_inference_steps, self.device, None, sigmas=sigmas, mu=mu)
        schedule = Schedule(sigmas=pipe.scheduler.sigmas.to(self.device, torch.float32).clone(),
                            timesteps=timesteps.clone())
        self._sizes.setdefault(d["video"] + d["audio"], set()).add((height, width))
        self._sigma_of.update(zip(schedule.timesteps.tolist(), schedule.sigmas[:-1].tolist()))
        return schedule

    def _sigma(self, t: torch.Tensor) -> torch.Tensor:
        """(B, 1, 1) the scheduler's sigma of each timestep (the pipeline's ``scheduler.sigmas[step]``); a timestep
        between the schedule's steps (StepwiseFlowGRPO) gets ``t / num_train_timesteps``."""
        scale = self.pipe.scheduler.config.num_train_timesteps
        sigmas = [self._sigma_of.get(v, v / scale) for v in t.tolist()]  # float32 values, exact as floats
        return torch.tensor(sigmas, dtype=torch.float32, device=t.device)[:, None, None]

    def velocity(self, model, x, timestep, embeds, guidance_scale, detach_uncond=False) -> torch.Tensor:
        pipe = self.pipe
        d, height, width = self._size_of(x)
        b = x.shape[0]
        video, audio = self.split(x, height, width)
        t = torch.as_tensor(timestep, device=x.device)
        t = t.expand(b) if t.ndim == 0 else t
        sigma = self._sigma(t)
        dtype = embeds["connector_prompt_embeds"].dtype  # the pipeline casts the latents to the embeddings' dtype
        fps = self._conditioning_frame_rate()
        coords = pipe.transformer.rope.prepare_video_coords(b, d["frames"], d["h"], d["w"], x.device, fps=fps)
        audio_coords = pipe.transformer.audio_rope.prepare_audio_coords(b, d["audio_frames"], x.device)
        cfg = (guidance_scale > 1 or self.audio_guidance_scale > 1) and "negative_connector_prompt_embeds" in embeds

        def call(v, a, prefix_embeds, ts, vc, ac, **kw):
            out_v, out_a = model(
                hidden_states=v.to(dtype), audio_hidden_states=a.to(dtype), encoder_hidden_states=prefix_embeds[0],
                audio_encoder_hidden_states=prefix_embeds[1], timestep=ts, sigma=ts,
                encoder_attention_mask=prefix_embeds[2], audio_encoder_attention_mask=prefix_embeds[2],
                num_frames=d["frames"], height=d["h"], width=d["w"], fps=fps, audio_num_frames=d["audio_frames"],
                video_coords=vc, audio_coords=ac, perturbation_mask=None, use_cross_timestep=self.use_cross_timestep,
                attention_kwargs=None, return_dict=False, **kw)
            return out_v.float(), out_a.float()

        names = ("connector_prompt_embeds", "connector_audio_prompt_embeds", "connector_attention_mask")
        positive = tuple(embeds[n] for n in names)
        if cfg:
            both = tuple(torch.cat([embeds[f"negative_{n}"], embeds[n]]) for n in names)
            rep = (2,) + (1,) * (coords.ndim - 1)
            v_all, a_all = call(torch.cat([video] * 2), torch.cat([audio] * 2), both, torch.cat([t, t]),
                                coords.repeat(rep), audio_coords.repeat((2,) + (1,) * (audio_coords.ndim - 1)),
                                isolate_modalities=False, spatio_temporal_guidance_blocks=None)
            v_u, v_c = v_all.chunk(2)
            a_u, a_c = a_all.chunk(2)
            v_c, v_u = video - v_c * sigma, video - v_u * sigma
            a_c, a_u = audio - a_c * sigma, audio - a_u * sigma
            if detach_uncond:
                v_u, a_u = v_u.detach(), a_u.detach()
            v_deltas = [(guidance_scale - 1) * (v_c - v_u)]
            a_deltas = [(self.audio_guidance_scale - 1) * (a_c - a_u)]
        else:
            v_c, a_c = call(video, audio, positive, t, coords, audio_coords, isolate_modalities=False,
                            spatio_temporal_guidance_blocks=None)
            v_c, a_c = video - v_c * sigma, audio - a_c * sigma
            v_deltas, a_deltas = [], []
        for enabled, kw, scales in (
                (self.stg_scale > 0 or self.audio_stg_scale > 0,
                 dict(isolate_modalities=False, spatio_temporal_guidance_blocks=self.stg_blocks),
                 (self.stg_scale, self.audio_stg_scale)),
                (self.modality_scale > 1 or self.audio_modality_scale > 1,
                 dict(isolate_modalities=True, spatio_temporal_guidance_blocks=None),
                 (self.modality_scale - 1, self.audio_modality_scale - 1))):
            if not enabled:
                continue
            v_p, a_p = call(video, audio, positive, t, coords, audio_coords, **kw)
            v_p, a_p = video - v_p * sigma, audio - a_p * sigma
            if detach_uncond:
                v_p, a_p = v_p.detach(), a_p.detach()
            v_deltas.append(scales[0] * (v_c - v_p))
            a_deltas.append(scales[1] * (a_c - a_p))
        v_g, a_g = v_c, a_c
        for v_delta, a_delta in zip(v_deltas, a_deltas):  # the pipeline's order: cond + cfg + stg + modality
            v_g, a_g = v_g + v_delta, a_g + a_delta
        v_out = self._rescale(v_g, v_c, self.guidance_rescale)
        a_out = self._rescale(a_g, a_c, self.audio_guidance_rescale)
        v_vel, a_vel = (video - v_out) / sigma, (audio - a_out) / sigma
        return torch.cat([v_vel.flatten(1), a_vel.flatten(1)], dim=1)

    @staticmethod
    def _rescale(guided, cond, rescale):
        from diffusers.pipelines.ltx2.pipeline_ltx2 import rescale_noise_cfg

        return rescale_noise_cfg(guided, cond, guidance_rescale=rescale) if rescale > 0 else guided

    def _conditioning_frame_rate(self) -> float:
        from diffusers.pipelines.ltx2.pipeline_ltx2 import get_conditioning_frame_rate

        return get_conditioning_frame_rate(self.frame_rate, 1.0)

    # ------------------------------------------------------------------------------------------- decoding
    def pipe_latents(self, x) -> tuple[torch.Tensor, torch.Tensor]:
        """What ``pipe(output_type="latent")`` returns for states ``x``: the video latents (B, C, F', h, w) and the
        audio latents (B, C_a, L, M), unpacked and denormalised."""
        pipe = self.pipe
        d, height, width = self._size_of(x)
        video, audio = self.split(x, height, width)
        video = pipe._unpack_latents(video, d["frames"], d["h"], d["w"], pipe.transformer_spatial_patch_size,
                                     pipe.transformer_temporal_patch_size)
        video = pipe._denormalize_latents(video, pipe.vae.latents_mean, pipe.vae.latents_std,
                                          pipe.vae.config.scaling_factor)
        audio = pipe._denormalize_audio_latents(audio, pipe.audio_vae.latents_mean, pipe.audio_vae.latents_std)
        return video, pipe._unpack_audio_latents(audio, d["audio_frames"], num_mel_bins=d["mel"])

    def decode(self, latents) -> torch.Tensor:
        """Videos (B, F, 3, H, W) float32 in [0, 1], as ``pipe()`` decodes its video."""
        vae = self.pipe.vae
        video, _ = self.pipe_latents(latents)
        frames = vae.decode(video.to(vae.dtype), None, return_dict=False)[0]
        return (frames.float() / 2 + 0.5).clamp(0, 1).permute(0, 2, 1, 3, 4)

    def decode_audio(self, latents) -> torch.Tensor:
        """The waveforms ``pipe()`` returns as ``audio`` (B, channels, samples): the audio VAE's mel spectrograms
        through the vocoder."""
        pipe = self.pipe
        _, audio = self.pipe_latents(latents)
        return pipe.vocoder(pipe.audio_vae.decode(audio.to(pipe.audio_vae.dtype), return_dict=False)[0])
