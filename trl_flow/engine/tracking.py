"""Samples in the experiment trackers: images with prompt and reward captions, and reward histograms.

Everything goes through the accelerate trackers the trainer was built with (``report_to``): on tensorboard
``tracker.log_images`` (the images) plus a text entry with the captions and ``add_histogram``; on wandb
``wandb.Image(..., caption=...)`` and ``wandb.Histogram``. Other trackers get the scalar metrics only.

Tags: ``images/<split>`` (+ ``images/<split>/captions`` on tensorboard), ``hist/<split>/reward`` and
``hist/<split>/rewards/<reward name>``, where split is ``train`` (the rollout) or ``eval``. Scalars go to the
trackers as TRL's trainers log them (:func:`tracker_metrics`): ``train/<name>`` (``train/reward``, ``train/loss``,
``train/time/rollout_s``) and ``eval/<name>``; ``output_dir/log_history.jsonl`` keeps the names unprefixed, as
``trainer.state.log_history``. Tensorboard's event files are written to ``output_dir/<run_name>/`` (accelerate's
``project_dir`` and the tracker's run name; default run name: the method's, e.g. ``flow_grpo``).

The image grids in ``output_dir/samples/`` (``train_step_<n>.png`` every ``log_images_steps``, ``eval_step_<n>.png``
at each evaluation) get a caption file beside them, ``<grid>.txt``: one line per image, in the grid's order (rows of
8), with its prompt and rewards (:func:`write_captions`).
"""

from __future__ import annotations

import torch

from ..video import grid, to_pil  # noqa: F401  (grid: re-exported for the trainers)

MAX_LOGGED_IMAGES = 16


def captions(prompts: list[str], rewards: torch.Tensor, per_func: dict[str, torch.Tensor]) -> list[str]:
    """``"<prompt> | reward 0.512 (pickscore 0.212, ocr 0.300)"`` per sample; ``nan`` marks a missing score."""
    out = []
    for i, prompt in enumerate(prompts):
        parts = ", ".join(f"{name} {float(r[i]):.4g}" for name, r in per_func.items())
        text = f"{prompt} | reward {float(rewards[i]):.4g}"
        out.append(f"{text} ({parts})" if len(per_func) > 1 else text)
    return out


def tracker_metrics(entry: dict) -> dict:
    """A log entry's scalars as the trackers get them: ``eval/...`` as they are, the others under ``train/``
    (TRL's layout: ``train/reward``, ``eval/reward``); ``step`` is left out (it is the tracker's step)."""
    return {k if k.startswith("eval/") else f"train/{k}": v for k, v in entry.items() if k != "step"}


def write_captions(accelerator, output_dir: str, filename: str, prompts: list[str], rewards: torch.Tensor,
                   per_func: dict[str, torch.Tensor], n: int = 64, cols: int = 8) -> None:
    """``output_dir/samples/<filename>`` beside the grid of the same name (``.png`` -> ``.txt``): one line per image
    of the grid (its first ``n``), ``row r, column c: <prompt> | reward 0.512 (...)``. Main process only."""
    import os

    if not accelerator.is_main_process or not len(prompts):
        return
    n = min(n, len(prompts))
    texts = captions(prompts[:n], rewards[:n], {k: v[:n] for k, v in per_func.items()})
    folder = os.path.join(output_dir, "samples")
    os.makedirs(folder, exist_ok=True)
    cols = min(cols, n)
    with open(os.path.join(folder, os.path.splitext(filename)[0] + ".txt"), "w", encoding="utf-8") as f:
        f.writelines(f"row {i // cols}, column {i % cols}: {t}\n" for i, t in enumerate(texts))


def log_images(accelerator, split: str, images: torch.Tensor, prompts: list[str], rewards: torch.Tensor,
               per_func: dict[str, torch.Tensor], step: int, max_images: int = MAX_LOGGED_IMAGES) -> None:
    """Log up to ``max_images`` images (B, 3, H, W) in [0, 1] with their captions; videos (B, F, 3, H, W) are
    logged as frame strips (up to 8 evenly spaced frames side by side, :func:`trl_flow.video.frame_strips`).
    Main process only."""
    if not accelerator.is_main_process or images is None or not len(images):
        return
    n = min(max_images, len(images))
    images = images[:n].detach().float().clamp(0, 1).cpu()
    if images.ndim == 5:
        from ..video import frame_strips

        images = frame_strips(images)
    texts = captions(prompts[:n], rewards[:n], {k: v[:n] for k, v in per_func.items()})
    for tracker in accelerator.trackers:
        if tracker.name == "tensorboard":
            tracker.log_images({f"images/{split}": images}, step=step, dataformats="NCHW")
            tracker.log({f"images/{split}/captions": "\n\n".join(f"{i}. {t}" for i, t in enumerate(texts))}, step=step)
        elif tracker.name == "wandb":
            import wandb

            pil = to_pil(images)
            tracker.log({f"images/{split}": [wandb.Image(p, caption=t) for p, t in zip(pil, texts)]}, step=step)


def log_histograms(accelerator, split: str, rewards: torch.Tensor, per_func: dict[str, torch.Tensor],
                   step: int) -> None:
    """Histograms of the (gathered) rewards, combined and per reward function; NaNs (no score) are left out."""
    if not accelerator.is_main_process:
        return
    values = {f"hist/{split}/reward": rewards, **{f"hist/{split}/rewards/{k}": v for k, v in per_func.items()}}
    values = {k: v.detach().float().cpu() for k, v in values.items()}
    values = {k: v[~torch.isnan(v)] for k, v in values.items()}
    values = {k: v for k, v in values.items() if v.numel()}
    if not values:
        return
    for tracker in accelerator.trackers:
        if tracker.name == "tensorboard":
            writer = accelerator.get_tracker("tensorboard", unwrap=True)
            for k, v in values.items():
                writer.add_histogram(k, v, global_step=step)
            writer.flush()
        elif tracker.name == "wandb":
            import wandb

            tracker.log({k: wandb.Histogram(v.numpy()) for k, v in values.items()}, step=step)


def log_rollout(trainer, rollout, step: int) -> None:
    """Called by the trainer after every iteration (on every process: the rewards are gathered). Histograms on
    logging steps, images every ``log_images_steps``."""
    cfg = trainer.config
    if cfg.log_images_steps and step % cfg.log_images_steps == 0 and rollout.images is not None \
            and rollout.images.ndim == 4:  # the captions of the trainer's samples/train_step_<step>.png
        write_captions(trainer.accelerator, cfg.output_dir, f"train_step_{step}.png", rollout.prompts,
                       rollout.rewards, rollout.rewards_per_func)
    if not cfg.report_to:
        return
    if step % cfg.logging_steps == 0 or step == cfg.max_steps:
        per_func = {k: trainer.gather(v) for k, v in rollout.rewards_per_func.items()}
        log_histograms(trainer.accelerator, "train", trainer.gather(rollout.rewards), per_func, step)
    if cfg.log_images_steps and step % cfg.log_images_steps == 0:
        log_images(trainer.accelerator, "train", rollout.images, rollout.prompts, rollout.rewards,
                   rollout.rewards_per_func, step)


def log_eval(trainer, images, prompts, rewards, per_func, all_rewards, all_per_func, step: int) -> None:
    """Called by ``evaluate``: this process's images and scores, and the gathered ones for the histograms."""
    if images is not None and images.ndim == 4:  # the captions of the trainer's samples/eval_step_<step>.png
        write_captions(trainer.accelerator, trainer.config.output_dir, f"eval_step_{step}.png", prompts, rewards,
                       per_func)
    if not trainer.config.report_to or not trainer.accelerator.trackers:
        return
    log_histograms(trainer.accelerator, "eval", all_rewards, all_per_func, step)
    log_images(trainer.accelerator, "eval", images, prompts, rewards, per_func, step)
