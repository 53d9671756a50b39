"""The base of the shipped reward models: optional extras, cached loading, device and dtype, batching, video.

A :class:`RewardModel` is a reward callable ``reward(images, prompts, **columns) -> list[float | None]`` whose
weights are loaded on first use (once per process for a given checkpoint, device and dtype, shared by every
instance) and run without gradient in batches of ``batch_size``. Images are (B, 3, H, W) floats in [0, 1]; video
(B, F, 3, H, W) is scored frame by frame and each sample gets the mean over its frames.

Device and dtype: what the constructor was given, else what the trainer sets through :meth:`RewardModel.prepare`
(its device and mixed-precision dtype), else the images' device and float32.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
from collections.abc import Sequence

import torch

_MODEL_CACHE: dict[tuple, object] = {}
_CACHE_LOCK = threading.Lock()
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def clear_model_cache() -> None:
    """Drop every cached reward model (frees their memory once no reward instance holds them)."""
    with _CACHE_LOCK:
        _MODEL_CACHE.clear()


def require_extra(reward: str, modules: Sequence[str], extra: str) -> None:
    """Raise an ``ImportError`` naming the pip extra when one of ``modules`` cannot be imported."""
    for mod in modules:
        if mod in sys.modules:  # already imported (or blocked with None)
            missing = sys.modules[mod] is None
        else:
            try:
                missing = importlib.util.find_spec(mod) is None
            except (ImportError, ValueError):
                missing = True
        if missing:
            raise ImportError(
                f"reward {reward!r} needs the Python package `{mod}`, which is not installed: "
                f"pip install 'trl_flow[{extra}]'"
            )


def as_dtype(dtype) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    raise ValueError(f"dtype={dtype!r}: use a torch.dtype or one of {sorted(_DTYPES)}")


def check_images(images, n: int, who: str) -> torch.Tensor:
    """``images`` as a float tensor (B, 3, H, W) or (B, F, 3, H, W) with B == n, else a ``ValueError``."""
    if not isinstance(images, torch.Tensor):
        raise TypeError(f"{who}: images must be a float tensor (B, 3, H, W) in [0, 1], got {type(images).__name__}")
    if not images.is_floating_point():
        raise TypeError(f"{who}: images must be floats in [0, 1], got {images.dtype}")
    video = images.ndim == 5 and images.shape[2] == 3
    if not (video or (images.ndim == 4 and images.shape[1] == 3)):
        raise ValueError(f"{who}: images must be (B, 3, H, W) or video (B, F, 3, H, W), got {tuple(images.shape)}")
    if images.shape[0] != n:
        raise ValueError(f"{who}: got {images.shape[0]} images for {n} prompts")
    return images


def to_uint8(images: torch.Tensor) -> torch.Tensor:
    """(..., 3, H, W) float in [0, 1] -> uint8 on CPU (rounded), what image processors and PNG expect."""
    return (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).cpu()


def to_pil(images: torch.Tensor) -> list:
    """(B, 3, H, W) float in [0, 1] -> B RGB PIL images."""
    from PIL import Image

    return [Image.fromarray(a) for a in to_uint8(images).permute(0, 2, 3, 1).numpy()]


def features(out) -> torch.Tensor:
    """The embedding tensor of ``get_image_features`` / ``get_text_features`` (a tensor in transformers 4,
    an output with ``pooler_output`` in transformers 5)."""
    return out if isinstance(out, torch.Tensor) else out.pooler_output


class RewardModel:
    """Base class of the shipped reward models. Subclasses set ``name`` (the logged name), ``extra`` and
    ``required_modules`` (checked when the reward is built) and implement :meth:`cache_key`, :meth:`load_components`
    and :meth:`score_batch`."""

    name = "reward_model"
    extra: str | None = None
    required_modules: tuple[str, ...] = ()

    def __init__(self, device=None, dtype=None, batch_size: int = 32):
        if self.extra is not None:
            require_extra(self.name, self.required_modules, self.extra)
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"{self.name}: batch_size={batch_size!r} must be an integer >= 1")
        self.__name__ = self.name
        self.device = torch.device(device) if device is not None else None
        self.dtype = as_dtype(dtype)
        self.batch_size = batch_size

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.cache_key())})"

    # ------------------------------------------------------------------------------------- to implement
    def cache_key(self) -> tuple:
        """What identifies the loaded weights (e.g. model ids), as a tuple of (name, value) pairs."""
        raise NotImplementedError

    def load_components(self, device: torch.device, dtype: torch.dtype):
        """Load the weights (real hub ids by default) onto ``device`` in ``dtype``, frozen, in eval mode."""
        raise NotImplementedError

    def score_batch(self, components, images: torch.Tensor, prompts: list[str], columns: dict[str, list]):
        """Scores of one batch: images (b, 3, H, W) float in [0, 1] -> b floats (or None)."""
        raise NotImplementedError

    # ------------------------------------------------------------------------------------------ shared
    def prepare(self, device, dtype) -> None:
        """Set the device and dtype the trainer runs on, unless the constructor fixed them."""
        if self.device is None and device is not None:
            self.device = torch.device(device)
        if self.dtype is None and dtype is not None:
            self.dtype = as_dtype(dtype)

    def load(self, device=None, dtype=None):
        """The loaded components for ``device`` / ``dtype`` (default: this reward's), loaded at most once."""
        device = torch.device(device or self.device or "cpu")
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        dtype = as_dtype(dtype) or self.dtype or torch.float32
        key = (type(self).__name__, self.cache_key(), str(device), str(dtype))
        with _CACHE_LOCK:  # one loader at a time: two rewards asking for the same weights share one copy
            if key not in _MODEL_CACHE:
                _MODEL_CACHE[key] = self.load_components(device, dtype)
            return _MODEL_CACHE[key]

    @torch.no_grad()
    def __call__(self, images, prompts, **columns) -> list[float | None]:
        prompts = list(prompts)
        images = check_images(images, len(prompts), self.name)
        components = self.load(self.device or images.device)
        if images.ndim == 5:  # video: score every frame, average per sample over the frames that got a score
            b, f = images.shape[:2]
            frames = images.reshape(b * f, *images.shape[2:])
            rep = {k: vals.repeat_interleave(f, 0) if isinstance(vals, torch.Tensor)
                   else [v for v in vals for _ in range(f)]
                   for k, vals in columns.items()}
            scores = self._score_all(components, frames, [p for p in prompts for _ in range(f)], rep)
            out = []
            for i in range(b):
                vals = [s for s in scores[i * f : (i + 1) * f] if s is not None]
                out.append(sum(vals) / len(vals) if vals else None)
            return out
        return self._score_all(components, images, prompts, columns)

    def _score_all(self, components, images, prompts, columns) -> list[float | None]:
        out: list[float | None] = []
        for lo in range(0, len(prompts), self.batch_size):
            hi = lo + self.batch_size
            cols = {k: v[lo:hi] if isinstance(v, torch.Tensor) else list(v[lo:hi]) for k, v in columns.items()}
            out.extend(self.score_batch(components, images[lo:hi], prompts[lo:hi], cols))
        return out


def reward_factory(cls):
    """The lowercase factory of a reward class (``pickscore(**kwargs) -> PickScoreReward``), which refuses to be
    used as the reward itself (a common slip: ``rewards=[pickscore]`` instead of ``[pickscore()]``)."""

    def factory(*args, **kwargs):
        if args and isinstance(args[0], torch.Tensor):
            raise TypeError(f"{cls.name} builds the reward; call it first: rewards=[{cls.name}()], not [{cls.name}]")
        return cls(*args, **kwargs)

    factory.__name__ = factory.__qualname__ = cls.name
    factory.__doc__ = f"Build a :class:`{cls.__name__}` (same arguments).\n\n" + (cls.__doc__ or "")
    factory.reward_class = cls
    return factory
