"""Video helpers: image rewards on videos, frame strips and video files for sample logging.

A video batch is a float tensor (B, F, 3, H, W) in [0, 1], as a video pipeline's adapter decodes it and as video
rewards receive it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable

import torch

REDUCTIONS = ("mean", "min", "max")


def per_frame(reward: Callable, reduce: str = "mean", frame_stride: int = 1, batch_size: int | None = None):
    """Turn an image reward into a video reward: score frames ``0, s, 2s, ...`` of every video as images and reduce
    the frame scores.

    Args:
        reward: an image reward ``reward(images (N, 3, H, W), prompts, **columns) -> N scores`` (None/NaN: no score).
        reduce: ``"mean"``, ``"min"`` or ``"max"`` over the scored frames; frames without a score are left out, and a
            video none of whose frames got a score gets None (skipped, as for any reward).
        frame_stride: score every ``frame_stride``-th frame (cheaper rewards on long videos).
        batch_size: call ``reward`` on at most this many frames at a time (default: all frames of the batch).

    Returns a reward ``(videos (B, F, 3, H, W), prompts, **columns) -> list of B floats or None`` with the image
    reward's name (and its ``prepare``, so a reward model still moves to the trainer's device and dtype); each frame
    gets its video's prompt and columns. A 4-D (image) batch is passed through unchanged. (trl_flow's reward models
    already score a video as the mean over its frames; ``per_frame`` serves any callable and other reductions.)
    """
    if reduce not in REDUCTIONS:
        raise ValueError(f"per_frame: reduce must be one of {REDUCTIONS}, got {reduce!r}")
    if not isinstance(frame_stride, int) or frame_stride < 1:
        raise ValueError(f"per_frame: frame_stride must be an integer >= 1, got {frame_stride!r}")
    if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
        raise ValueError(f"per_frame: batch_size must be an integer >= 1 or None, got {batch_size!r}")

    def video_reward(images: torch.Tensor, prompts: list[str], **columns):
        if images.ndim == 4:
            return reward(images, prompts, **columns)
        if images.ndim != 5:
            raise ValueError(f"per_frame: expected videos (B, F, 3, H, W), got shape {tuple(images.shape)}")
        frames = images[:, ::frame_stride]
        b, f = frames.shape[:2]
        flat = frames.reshape(b * f, *frames.shape[2:])
        rep = lambda values: [v for v in values for _ in range(f)]  # noqa: E731
        rep_cols = {k: rep(v) for k, v in columns.items()}
        step = batch_size or len(flat)
        scores = []
        for lo in range(0, len(flat), step):
            sl = slice(lo, lo + step)
            out = reward(flat[sl], rep(prompts)[sl], **{k: v[sl] for k, v in rep_cols.items()})
            if isinstance(out, torch.Tensor):
                out = out.detach().float().cpu().reshape(-1).tolist()
            out = list(out)
            if len(out) != len(flat[sl]):
                raise ValueError(f"per_frame: the image reward returned {len(out)} scores for {len(flat[sl])} frames")
            scores += [math.nan if v is None else float(v) for v in out]
        s = torch.tensor(scores, dtype=torch.float64).view(b, f)
        s[torch.isinf(s)] = math.nan
        ok = ~torch.isnan(s)
        if reduce == "mean":
            red = torch.where(ok, s, 0.0).sum(1) / ok.sum(1).clamp_min(1)
        elif reduce == "min":
            red = torch.where(ok, s, math.inf).min(1).values
        else:
            red = torch.where(ok, s, -math.inf).max(1).values
        return [float(r) if any_ok else None for r, any_ok in zip(red.tolist(), ok.any(1).tolist())]

    name = getattr(reward, "__name__", None) or type(reward).__name__
    video_reward.__name__ = name
    video_reward.__qualname__ = name
    video_reward.__doc__ = f"{name} on every {frame_stride}-th frame, {reduce} over frames (trl_flow.video.per_frame)."
    if callable(getattr(reward, "prepare", None)):
        video_reward.prepare = reward.prepare
    return video_reward


def frame_strips(videos: torch.Tensor, max_frames: int = 8) -> torch.Tensor:
    """(B, F, 3, H, W) -> (B, 3, H, n W): ``n = min(F, max_frames)`` evenly spaced frames side by side."""
    if videos.ndim != 5:
        raise ValueError(f"frame_strips: expected videos (B, F, 3, H, W), got shape {tuple(videos.shape)}")
    f = videos.shape[1]
    idx = torch.linspace(0, f - 1, min(f, max_frames)).round().long()
    picked = videos[:, idx]  # (B, n, 3, H, W)
    return torch.cat(list(picked.unbind(1)), dim=-1)


def _to_uint8_frames(video: torch.Tensor):
    """(F, 3, H, W) in [0, 1] -> list of F PIL images."""
    from PIL import Image

    arr = (video.detach().float().clamp(0, 1).cpu().permute(0, 2, 3, 1).numpy() * 255).round().astype("uint8")
    return [Image.fromarray(a) for a in arr]


def _mp4_available() -> bool:
    try:
        import imageio  # noqa: F401
        import imageio_ffmpeg  # noqa: F401
    except ImportError:
        return False
    return True


def save_videos(videos: torch.Tensor, out_dir: str, filename: str, fps: int = 8, max_frames: int = 8) -> list[str]:
    """Write sample videos (B, F, 3, H, W) in [0, 1] for inspection.

    ``out_dir/filename`` (a ``.png``) gets a grid with one frame strip (:func:`frame_strips`) per row;
    ``out_dir/<stem>_<i>.mp4`` (diffusers' ``export_to_video``, needs ``imageio`` and ``imageio-ffmpeg``) or, without
    them, ``<stem>_<i>.gif`` (``export_to_gif``) holds each video. Returns the written paths.
    """
    from diffusers.utils import export_to_gif, export_to_video, make_image_grid

    os.makedirs(out_dir, exist_ok=True)
    strips = frame_strips(videos, max_frames)
    rows = [_to_uint8_frames(s[None])[0] for s in strips]
    grid_path = os.path.join(out_dir, filename)
    make_image_grid(rows, rows=len(rows), cols=1).save(grid_path)
    paths = [grid_path]
    stem = os.path.splitext(filename)[0]
    mp4 = _mp4_available()
    for i, video in enumerate(videos):
        frames = _to_uint8_frames(video)
        if mp4:
            paths.append(export_to_video(frames, os.path.join(out_dir, f"{stem}_{i}.mp4"), fps=fps))
        else:
            paths.append(export_to_gif(frames, os.path.join(out_dir, f"{stem}_{i}.gif"), fps=fps))
    return paths


def to_pil(images: torch.Tensor):
    from diffusers.image_processor import VaeImageProcessor

    # images are already in [0, 1] (the trainer's decode denormalises), so no `postprocess` denormalisation
    return VaeImageProcessor.numpy_to_pil(VaeImageProcessor.pt_to_numpy(images))


def grid(images: torch.Tensor, cols: int = 8):
    """A PIL grid of images (B, 3, H, W) in [0, 1], ``cols`` wide, the last row padded with black."""
    from diffusers.utils import make_image_grid
    from PIL import Image

    pil = to_pil(images.detach().float().clamp(0, 1).cpu())
    cols = min(cols, len(pil))
    rows = math.ceil(len(pil) / cols)
    pil += [Image.new("RGB", pil[0].size)] * (rows * cols - len(pil))
    return make_image_grid(pil, rows=rows, cols=cols)
