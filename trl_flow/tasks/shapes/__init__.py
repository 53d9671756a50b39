"""The shapes task: a CPU-scale GenEval-like text-to-image benchmark.

Flat red / green / blue circles, squares and triangles on black, 32x32 images. ``grammar`` (prompts, parser,
fixed train/test split), ``render`` (ground truth), ``reward`` (detector, scores, reward functions with the
contract ``reward(images (B, 3, H, W) in [0, 1], prompts, **columns) -> list[float]``), ``model`` (the tiny
StableDiffusion3 pipeline and its committed base checkpoint), ``benchmark`` (fixed evaluation sets). The editing
task: ``edit`` (instruction grammar, source / target scene pairs, split), ``edit_reward`` (the ``shapes_edit``
detector reward, which takes ``source_image=``), ``model_edit`` (the tiny FluxKontextPipeline and its committed
editing base).
"""

from .grammar import (
    CATEGORIES,
    rl_train_prompts,
    val_prompts,
    COLORS,
    RELATIONS,
    SHAPES,
    ObjectSpec,
    PromptSpec,
    all_prompts,
    parse_prompt,
    test_prompts,
    train_prompts,
)
from .model import (
    BASE_MODEL_DIR,
    BASE_MODEL_VARIANTS,
    NOISY_BASE_MODEL_DIR,
    BASE_SHIFT,
    DEFAULT_GUIDANCE_SCALE,
    DEFAULT_NUM_INFERENCE_STEPS,
    DEFAULT_RESOLUTION,
    MAX_SEQUENCE_LENGTH,
    build_pipeline,
    generate,
    load_base_pipeline,
)
from .render import render, render_batch
from .reward import (
    dense_score,
    detect,
    evaluate,
    score,
    shape_cleanliness,
    shapes_dense_reward,
    shapes_partial_reward,
    shapes_relation_reward,
    shapes_strict_reward,
)
from .grammar import noisy_caption
from .edit import EditSpec, edit_dataset, parse_instruction, render_pair
from .edit_reward import evaluate_edits, shapes_edit_partial_reward, shapes_edit_reward
from .model_edit import EDIT_BASE_MODEL_DIR, build_edit_pipeline, edit_generate, load_edit_base_pipeline
from .benchmark import eval_prompts, evaluate_pipeline

__all__ = [
    "CATEGORIES",
    "COLORS",
    "RELATIONS",
    "SHAPES",
    "ObjectSpec",
    "PromptSpec",
    "all_prompts",
    "parse_prompt",
    "test_prompts",
    "train_prompts",
    "BASE_MODEL_DIR",
    "BASE_MODEL_VARIANTS",
    "NOISY_BASE_MODEL_DIR",
    "BASE_SHIFT",
    "DEFAULT_GUIDANCE_SCALE",
    "DEFAULT_NUM_INFERENCE_STEPS",
    "DEFAULT_RESOLUTION",
    "MAX_SEQUENCE_LENGTH",
    "build_pipeline",
    "generate",
    "load_base_pipeline",
    "render",
    "render_batch",
    "detect",
    "evaluate",
    "score",
    "shape_cleanliness",
    "shapes_partial_reward",
    "shapes_dense_reward",
    "shapes_relation_reward",
    "dense_score",
    "rl_train_prompts",
    "val_prompts",
    "shapes_strict_reward",
    "eval_prompts",
    "noisy_caption",
    "evaluate_pipeline",
    "EditSpec",
    "edit_dataset",
    "parse_instruction",
    "render_pair",
    "evaluate_edits",
    "shapes_edit_reward",
    "shapes_edit_partial_reward",
    "EDIT_BASE_MODEL_DIR",
    "build_edit_pipeline",
    "edit_generate",
    "load_edit_base_pipeline",
]
