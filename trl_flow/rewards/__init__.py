"""Rewards: the contract, how rewards combine, the shipped reward models, remote rewards and VLM judges.

A reward is any callable ``reward(images, prompts, **columns) -> list[float | None]`` where ``images`` is a float
tensor (B, 3, H, W) in [0, 1] (video: (B, F, 3, H, W)), ``prompts`` a list of B strings and ``columns`` the
prompts' other dataset columns, each a list of B values. ``None`` or NaN means "no score for this sample".
An editing run also passes ``source_image``, the decoded sources (B, 3, H, W) float32 in [0, 1] at the generated
size.

- :mod:`.core`: the contract, :func:`compute_rewards` (weighted sum), ``jpeg_(in)compressibility``.
- :mod:`.clip`, :mod:`.hps`, :mod:`.ocr`: ``pickscore()``, ``clip_score()``, ``aesthetic()``, ``hpsv2()``,
  ``image_reward()``, ``ocr()`` (factories: call them to build the reward; weights load on first use).
- :mod:`.remote`, :mod:`.server`, :mod:`.wire`: ``RemoteReward`` and ``trl-flow reward-server``.
- :mod:`.judge`: ``VLMJudgeReward`` on an OpenAI-compatible endpoint.
- :mod:`.editing`: ``edit_preservation()``, how much of an editing run's source image is preserved.
- :mod:`.registry`: ``get_reward("pickscore")`` / ``get_reward("module:callable")``.
- :mod:`.scheduling`: scoring that overlaps sampling (``reward_num_workers``).

See docs/rewards.md.
"""

from .base import RewardModel, clear_model_cache
from .clip import AestheticReward, CLIPScoreReward, PickScoreReward, aesthetic, clip_score, pickscore
from .core import (
    RewardError,
    RewardFunc,
    call_scores,
    compute_rewards,
    jpeg_compressibility,
    jpeg_incompressibility,
    reward_name,
    validate_reward_funcs,
)
from .editing import EditPreservationReward, edit_preservation
from .hps import HPSv2Reward, ImageRewardReward, hpsv2, image_reward
from .judge import DEFAULT_RUBRIC, EDIT_RUBRIC, ScoreParser, VLMJudgeReward
from .ocr import OCRReward, ocr, ocr_similarity
from .registry import available_rewards, get_reward, register_function, register_reward
from .remote import RemoteReward, RemoteRewardError


def _shapes(name):
    def load():
        from ..tasks import shapes

        return getattr(shapes, f"{name}_reward")

    return load


for _f in (pickscore, clip_score, aesthetic, hpsv2, image_reward, ocr):
    register_reward(_f.__name__, _f)
register_reward("edit_preservation", edit_preservation)
register_reward("remote", RemoteReward)
register_reward("vlm_judge", VLMJudgeReward)
register_function("jpeg_compressibility", lambda: jpeg_compressibility)
register_function("jpeg_incompressibility", lambda: jpeg_incompressibility)
register_function("shapes_strict", _shapes("shapes_strict"))
register_function("shapes_partial", _shapes("shapes_partial"))
register_function("shapes_dense", _shapes("shapes_dense"))
register_function("shapes_relation", _shapes("shapes_relation"))
register_function("shapes_edit", _shapes("shapes_edit"))  # editing: needs source_image=
register_function("shapes_edit_partial", _shapes("shapes_edit_partial"))
del _f

__all__ = [
    "DEFAULT_RUBRIC",
    "EDIT_RUBRIC",
    "AestheticReward",
    "CLIPScoreReward",
    "EditPreservationReward",
    "HPSv2Reward",
    "ImageRewardReward",
    "OCRReward",
    "PickScoreReward",
    "RemoteReward",
    "RemoteRewardError",
    "RewardError",
    "RewardFunc",
    "RewardModel",
    "ScoreParser",
    "VLMJudgeReward",
    "aesthetic",
    "available_rewards",
    "call_scores",
    "clear_model_cache",
    "clip_score",
    "compute_rewards",
    "edit_preservation",
    "get_reward",
    "hpsv2",
    "image_reward",
    "jpeg_compressibility",
    "jpeg_incompressibility",
    "ocr",
    "ocr_similarity",
    "pickscore",
    "register_function",
    "register_reward",
    "reward_name",
    "validate_reward_funcs",
]
