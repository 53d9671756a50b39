"""HPSv2 and ImageReward: human-preference rewards whose code is not in transformers (optional extras).

``hpsv2`` (extra ``hpsv2`` = ``open_clip_torch``) and ``image_reward`` (extra ``image-reward`` = the
``image-reward`` package) pin incompatible ``timm`` versions: install at most one of them next to the trainer, or
serve either behind ``trl-flow reward-server`` in its own environment (see docs/rewards.md).
"""

from __future__ import annotations

import os

import torch

from .base import RewardModel, reward_factory, to_pil

HPS_CHECKPOINTS = {"v2.0": "HPS_v2_compressed.pt", "v2.1": "HPS_v2.1_compressed.pt"}


class HPSv2Reward(RewardModel):
    """Human Preference Score v2 / v2.1 (Wu et al. 2023, arXiv 2306.09341): the cosine similarity of the
    HPS-finetuned OpenCLIP ViT-H-14 image and prompt embeddings, about 0.2-0.35 (the ``hpsv2`` package's score).
    The checkpoint is ``HPS_v2.1_compressed.pt`` (``version="v2.1"``) or ``HPS_v2_compressed.pt`` (``"v2.0"``) in
    the Hub repo (or local folder) ``checkpoint_name_or_path``."""

    name = "hpsv2"
    extra = "hpsv2"
    required_modules = ("open_clip",)

    def __init__(self, version: str = "v2.1", checkpoint_name_or_path: str = "xswu/HPSv2",
                 architecture: str = "ViT-H-14", device=None, dtype=None, batch_size: int = 32):
        if version not in HPS_CHECKPOINTS:
            raise ValueError(f"hpsv2: version={version!r} must be one of {sorted(HPS_CHECKPOINTS)}")
        super().__init__(device=device, dtype=dtype, batch_size=batch_size)
        self.version = version
        self.checkpoint_name_or_path = checkpoint_name_or_path
        self.architecture = architecture

    def cache_key(self):
        return (("version", self.version), ("checkpoint_name_or_path", self.checkpoint_name_or_path),
                ("architecture", self.architecture))

    def load_components(self, device, dtype):
        import open_clip

        filename = HPS_CHECKPOINTS[self.version]
        if os.path.isdir(self.checkpoint_name_or_path):
            path = os.path.join(self.checkpoint_name_or_path, filename)
        else:
            from huggingface_hub import hf_hub_download

            path = hf_hub_download(self.checkpoint_name_or_path, filename)
        model, _, preprocess = open_clip.create_model_and_transforms(self.architecture, pretrained=None)
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)  # tensors only: no pickled code runs
        model.load_state_dict(checkpoint.get("state_dict", checkpoint))
        tokenizer = open_clip.get_tokenizer(self.architecture)
        return model.to(device, dtype).eval().requires_grad_(False), preprocess, tokenizer

    def score_batch(self, components, images, prompts, columns):
        model, preprocess, tokenizer = components
        param = next(model.parameters())
        pixels = torch.stack([preprocess(im) for im in to_pil(images)]).to(param.device, param.dtype)
        img = model.encode_image(pixels).float()
        txt = model.encode_text(tokenizer(prompts).to(param.device)).float()
        img = img / img.norm(dim=-1, keepdim=True)
        txt = txt / txt.norm(dim=-1, keepdim=True)
        return (img * txt).sum(-1).tolist()


class ImageRewardReward(RewardModel):
    """ImageReward (Xu et al. 2023, arXiv 2304.05977): the BLIP-based reward model of the ``image-reward``
    package, loaded with ``ImageReward.load(model_name)`` (weights from the Hub repo ``THUDM/ImageReward``);
    standardised scores, about -2 to 2."""

    name = "image_reward"
    extra = "image-reward"
    required_modules = ("ImageReward",)

    def __init__(self, model_name: str = "ImageReward-v1.0", download_root: str | None = None, device=None,
                 dtype=None, batch_size: int = 32):
        super().__init__(device=device, dtype=dtype, batch_size=batch_size)
        self.model_name = model_name
        self.download_root = download_root

    def cache_key(self):
        return (("model_name", self.model_name), ("download_root", self.download_root))

    def load_components(self, device, dtype):
        import ImageReward

        kwargs = {"device": str(device)}
        if self.download_root is not None:
            kwargs["download_root"] = self.download_root
        model = ImageReward.load(self.model_name, **kwargs)
        return model.to(device=device, dtype=dtype).eval().requires_grad_(False)

    def score_batch(self, components, images, prompts, columns):
        pil = to_pil(images)
        out: list[float | None] = [None] * len(prompts)
        by_prompt: dict[str, list[int]] = {}
        for i, p in enumerate(prompts):
            by_prompt.setdefault(p, []).append(i)
        for prompt, rows in by_prompt.items():  # one text encoding per distinct prompt of the batch
            scores = components.score(prompt, [pil[i] for i in rows])
            scores = [scores] if isinstance(scores, (int, float)) else list(scores)
            if len(scores) != len(rows):
                raise RuntimeError(f"image_reward: ImageReward.score returned {len(scores)} scores for {len(rows)} "
                                   "images")
            for i, s in zip(rows, scores):
                out[i] = float(s)
        return out


hpsv2 = reward_factory(HPSv2Reward)
image_reward = reward_factory(ImageRewardReward)
