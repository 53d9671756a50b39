"""OCR reward: the text a prompt asks for (in quotes) against the text recognised in the image.

Recognition is TrOCR (``VisionEncoderDecoderModel`` + its processor, default ``microsoft/trocr-base-printed``), a
single-line recogniser: it suits images whose text is one line (signs, labels, titles). Flow-GRPO's OCR reward
uses PaddleOCR (detector + recogniser) instead; serve that behind ``trl-flow reward-server`` for parity.
"""

from __future__ import annotations

import re

from .base import RewardModel, reward_factory, to_uint8

_QUOTED = re.compile(r"\"([^\"]+)\"|\u201c([^\u201d]+)\u201d")


def quoted_text(prompt: str) -> str | None:
    """The text between double quotes (straight or curly) in ``prompt``, segments joined by a space; None if none."""
    parts = [a or b for a, b in _QUOTED.findall(prompt)]
    return " ".join(parts) if parts else None


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (insertions, deletions, substitutions) between two strings."""
    if len(a) < len(b):
        a, b = b, a
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def _normalise(text: str) -> str:
    return "".join(text.split()).lower()


def ocr_similarity(recognised: str, target: str) -> float | None:
    """``1 - min(d, |t|) / |t|`` with ``d`` the edit distance between the recognised text and the target ``t``,
    both lower-cased without whitespace; in [0, 1], None for an empty target."""
    r, t = _normalise(recognised), _normalise(target)
    if not t:
        return None
    return 1.0 - min(edit_distance(r, t), len(t)) / len(t)


class OCRReward(RewardModel):
    """Text rendering: :func:`ocr_similarity` of the TrOCR reading of each image and the quoted text of its prompt
    (or the dataset column ``text_column`` when given), in [0, 1]. A prompt without quoted text gets None."""

    name = "ocr"

    def __init__(self, model_name_or_path: str = "microsoft/trocr-base-printed", processor_name_or_path=None,
                 text_column: str | None = None, max_new_tokens: int = 64, device=None, dtype=None,
                 batch_size: int = 32):
        super().__init__(device=device, dtype=dtype, batch_size=batch_size)
        self.model_name_or_path = model_name_or_path
        self.processor_name_or_path = processor_name_or_path or model_name_or_path
        self.text_column = text_column
        self.max_new_tokens = max_new_tokens

    def cache_key(self):
        return (("model_name_or_path", self.model_name_or_path),
                ("processor_name_or_path", self.processor_name_or_path))

    def load_components(self, device, dtype):
        from transformers import TrOCRProcessor, VisionEncoderDecoderModel

        processor = TrOCRProcessor.from_pretrained(self.processor_name_or_path)
        model = VisionEncoderDecoderModel.from_pretrained(self.model_name_or_path)
        return model.to(device, dtype).eval().requires_grad_(False), processor

    def recognise(self, components, images) -> list[str]:
        """The text read in each image (b, 3, H, W)."""
        model, processor = components
        param = next(model.parameters())
        pixels = processor(images=list(to_uint8(images)), return_tensors="pt")["pixel_values"]
        ids = model.generate(pixels.to(param.device, param.dtype), max_new_tokens=self.max_new_tokens)
        return processor.batch_decode(ids, skip_special_tokens=True)

    def targets(self, prompts, columns) -> list[str | None]:
        if self.text_column is None:
            return [quoted_text(p) for p in prompts]
        if self.text_column not in columns:
            raise KeyError(f"ocr: text_column={self.text_column!r} is not a dataset column (have {sorted(columns)})")
        return [None if t is None else str(t) for t in columns[self.text_column]]

    def score_batch(self, components, images, prompts, columns):
        targets = self.targets(prompts, columns)
        if all(t is None for t in targets):
            return [None] * len(prompts)
        texts = self.recognise(components, images)
        return [None if t is None else ocr_similarity(r, t) for r, t in zip(texts, targets)]


ocr = reward_factory(OCRReward)
