"""CLIP-based rewards on ``transformers.CLIPModel``: PickScore, CLIP score and the LAION aesthetic predictor.

Images go through the checkpoint's own ``CLIPProcessor`` (as uint8, so every processor backend sees the same
pixels); embeddings come from ``get_image_features`` / ``get_text_features``.
"""

from __future__ import annotations

import os

import torch

from .base import RewardModel, features, reward_factory, to_uint8


def _load_clip(model_name_or_path: str, processor_name_or_path: str, device, dtype):
    from transformers import CLIPModel, CLIPProcessor

    processor = CLIPProcessor.from_pretrained(processor_name_or_path)
    model = CLIPModel.from_pretrained(model_name_or_path).to(device, dtype).eval().requires_grad_(False)
    return model, processor


def _embed(model, processor, images: torch.Tensor, prompts: list[str] | None):
    """L2-normalised image embeddings (b, D) and, with ``prompts``, text embeddings (b, D)."""
    param = next(model.parameters())
    pixels = processor(images=list(to_uint8(images)), return_tensors="pt")["pixel_values"]
    img = features(model.get_image_features(pixel_values=pixels.to(param.device, param.dtype))).float()
    img = img / img.norm(dim=-1, keepdim=True)
    if prompts is None:
        return img, None
    max_len = min(getattr(processor.tokenizer, "model_max_length", 77) or 77, 77)
    text = processor(text=prompts, padding=True, truncation=True, max_length=max_len, return_tensors="pt")
    text = {k: v.to(param.device) for k, v in text.items()}
    txt = features(model.get_text_features(**text)).float()
    return img, txt / txt.norm(dim=-1, keepdim=True)


class _CLIPReward(RewardModel):
    def __init__(self, model_name_or_path, processor_name_or_path=None, device=None, dtype=None, batch_size=32):
        super().__init__(device=device, dtype=dtype, batch_size=batch_size)
        self.model_name_or_path = model_name_or_path
        self.processor_name_or_path = processor_name_or_path or model_name_or_path

    def cache_key(self):
        return (("model_name_or_path", self.model_name_or_path),
                ("processor_name_or_path", self.processor_name_or_path))

    def load_components(self, device, dtype):
        return _load_clip(self.model_name_or_path, self.processor_name_or_path, device, dtype)


class PickScoreReward(_CLIPReward):
    """PickScore (Kirstain et al. 2023, arXiv 2305.01569): ``exp(logit_scale) * cos(image, prompt)`` with the
    PickScore CLIP-H checkpoint; about 17-24 on real images (Flow-GRPO trains on ``score / 26``: use
    ``reward_weights=[1 / 26]`` for the same scale)."""

    name = "pickscore"

    def __init__(self, model_name_or_path: str = "yuvalkirstain/PickScore_v1",
                 processor_name_or_path: str = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K", device=None, dtype=None,
                 batch_size: int = 32):
        super().__init__(model_name_or_path, processor_name_or_path, device, dtype, batch_size)

    def score_batch(self, components, images, prompts, columns):
        model, processor = components
        img, txt = _embed(model, processor, images, prompts)
        return (model.logit_scale.exp().float() * (img * txt).sum(-1)).tolist()


class CLIPScoreReward(_CLIPReward):
    """CLIP score: the cosine similarity of image and prompt embeddings, in [-1, 1] (about 0.2-0.35 for matching
    pairs with CLIP ViT-L/14; CLIPScore of Hessel et al. 2021 is ``2.5 * max(cos, 0)``)."""

    name = "clip_score"

    def __init__(self, model_name_or_path: str = "openai/clip-vit-large-patch14", processor_name_or_path=None,
                 device=None, dtype=None, batch_size: int = 32):
        super().__init__(model_name_or_path, processor_name_or_path, device, dtype, batch_size)

    def score_batch(self, components, images, prompts, columns):
        model, processor = components
        img, txt = _embed(model, processor, images, prompts)
        return (img * txt).sum(-1).tolist()


class AestheticMLP(torch.nn.Module):
    """The LAION improved-aesthetic-predictor head (linear layers with dropout, no activation) on normalised CLIP
    ViT-L/14 image embeddings (768) -> a 1-10 rating. Keys ``layers.{0,2,4,6,7}`` as in the published weights."""

    def __init__(self, in_dim: int = 768):
        super().__init__()
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(in_dim, 1024), torch.nn.Dropout(0.2), torch.nn.Linear(1024, 128), torch.nn.Dropout(0.2),
            torch.nn.Linear(128, 64), torch.nn.Dropout(0.1), torch.nn.Linear(64, 16), torch.nn.Linear(16, 1),
        )

    def forward(self, embeds: torch.Tensor) -> torch.Tensor:  # (b, in_dim) -> (b,)
        return self.layers(embeds).squeeze(-1)


class AestheticReward(_CLIPReward):
    """LAION aesthetic score (the ``sac+logos+ava1-l14-linearMSE`` MLP, as used by DDPO and Flow-GRPO): the MLP on
    the L2-normalised CLIP ViT-L/14 image embedding; roughly 1-10 (about 4-7 on generated images). Ignores the
    prompt. The MLP weights are ``mlp_filename`` in the Hub repo (or local folder) ``mlp_name_or_path``."""

    name = "aesthetic"

    def __init__(self, model_name_or_path: str = "openai/clip-vit-large-patch14",
                 mlp_name_or_path: str = "trl-lib/ddpo-aesthetic-predictor", mlp_filename: str = "aesthetic-model.pth",
                 processor_name_or_path=None, device=None, dtype=None, batch_size: int = 32):
        super().__init__(model_name_or_path, processor_name_or_path, device, dtype, batch_size)
        self.mlp_name_or_path = mlp_name_or_path
        self.mlp_filename = mlp_filename

    def cache_key(self):
        return super().cache_key() + (("mlp_name_or_path", self.mlp_name_or_path), ("mlp_filename", self.mlp_filename))

    def load_components(self, device, dtype):
        model, processor = super().load_components(device, dtype)
        if os.path.isdir(self.mlp_name_or_path):
            path = os.path.join(self.mlp_name_or_path, self.mlp_filename)
        else:
            from huggingface_hub import hf_hub_download

            path = hf_hub_download(self.mlp_name_or_path, self.mlp_filename)
        state = torch.load(path, map_location="cpu", weights_only=True)  # tensors only: no pickled code runs
        mlp = AestheticMLP(state["layers.0.weight"].shape[1])
        mlp.load_state_dict(state)
        return model, processor, mlp.to(device, dtype).eval().requires_grad_(False)

    def score_batch(self, components, images, prompts, columns):
        model, processor, mlp = components
        img, _ = _embed(model, processor, images, None)
        return mlp(img.to(next(mlp.parameters()).dtype)).float().tolist()


pickscore = reward_factory(PickScoreReward)
clip_score = reward_factory(CLIPScoreReward)
aesthetic = reward_factory(AestheticReward)
