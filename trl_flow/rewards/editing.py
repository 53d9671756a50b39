"""Editing rewards: they compare the generated image with the source image (``source_image=`` (B, 3, H, W)).

An editing run's rewards get, besides ``images`` and ``prompts``, the decoded source images as ``source_image``, a
float32 tensor (B, 3, H, W) in [0, 1] at the generated size (see :mod:`trl_flow.editing`).
"""

from __future__ import annotations

import math

import torch


class EditPreservationReward:
    """How much of the source survives outside the edited region: ``1 - trimmed mean`` of the per-pixel change.

    For a generated image G and its source S (both (3, H, W) in [0, 1]) the change of pixel p is
    ``d(p) = mean_c |G[c, p] - S[c, p]|`` in [0, 1]. The edit may change any ``edit_fraction`` of the pixels
    freely: the ``ceil(edit_fraction * H * W)`` pixels that changed most are taken as the edited region and left
    out; the reward is ``1 - mean(d)`` over the other pixels. 1: everything outside the (at most
    ``edit_fraction``-sized) edited region is exactly the source; 0: every other pixel went from black to white
    or back. It says nothing about whether the edit was made: combine it with an instruction-following reward (a
    VLM judge, a detector), e.g. ``reward_weights=[1.0, 0.5]``, or it rewards returning the source unchanged.

    ``edit_fraction`` in [0, 1): 0 scores the whole image. A sample without a source (``source_image`` missing)
    raises: this reward needs an editing dataset.
    """

    __name__ = "edit_preservation"

    def __init__(self, edit_fraction: float = 0.25):
        if not (isinstance(edit_fraction, (int, float)) and 0 <= edit_fraction < 1):
            raise ValueError(f"edit_preservation: edit_fraction={edit_fraction!r} must be a number in [0, 1)")
        self.edit_fraction = float(edit_fraction)

    def __call__(self, images, prompts, source_image=None, **columns) -> list[float]:
        if source_image is None:
            raise ValueError("edit_preservation needs source_image (an editing dataset with a `source_image` column "
                             "and an editing pipeline such as FluxKontextPipeline)")
        images = torch.as_tensor(images).float()
        source = torch.as_tensor(source_image).float().to(images.device)
        if images.ndim != 4 or source.shape != images.shape:
            raise ValueError(f"edit_preservation: images {tuple(images.shape)} and source_image "
                             f"{tuple(source.shape)} must both be (B, 3, H, W)")
        d = (images - source).abs().mean(dim=1).flatten(1)  # (B, H W)
        n = d.shape[1]
        keep = n - min(n - 1, math.ceil(self.edit_fraction * n)) if self.edit_fraction else n
        kept = d.sort(dim=1).values[:, :keep]
        return (1 - kept.mean(dim=1)).tolist()


def edit_preservation(edit_fraction: float = 0.25) -> EditPreservationReward:
    """The :class:`EditPreservationReward` (no download; registered as ``edit_preservation``)."""
    return EditPreservationReward(edit_fraction=edit_fraction)
