"""A tiny ``FluxKontextPipeline`` for tests: the tiny FLUX.1 pipeline's components in the editing pipeline."""

from __future__ import annotations


def tiny_flux_kontext_pipeline(seed: int = 0, num_layers: int = 1, num_single_layers: int = 1,
                               guidance_embeds: bool = True):
    """A real ``FluxKontextPipeline`` with the tiny random components of
    :func:`~trl_flow.testing.tiny_flux_pipeline` (CLIP + T5, FLUX.1's scheduler config, a 2x VAE, so sizes are
    multiples of 4), in eval mode. FLUX.1-Kontext-dev has FLUX.1-dev's structure (guidance embedding, 16-channel
    latents); only the pipeline differs. Use ``pipe(..., max_area=H * W, _auto_resize=False)`` to keep the
    generated and source sizes as given. Building it does not touch the global RNG."""
    from diffusers import FluxKontextPipeline

    from . import tiny_flux_pipeline

    flux = tiny_flux_pipeline(seed=seed, num_layers=num_layers, num_single_layers=num_single_layers,
                              guidance_embeds=guidance_embeds)
    pipe = FluxKontextPipeline(**{k: flux.components[k] for k in (
        "scheduler", "vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "transformer")})
    pipe.set_progress_bar_config(disable=True)
    return pipe
