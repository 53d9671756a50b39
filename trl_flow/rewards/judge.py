"""A vision-language model as a judge, through an OpenAI-compatible chat-completions endpoint (what vLLM, sglang
and most inference servers serve).

Each image is sent as a ``data:image/png;base64`` ``image_url`` part with the rubric (formatted with the prompt and
the sample's columns) as the text part; the answer text goes through the parser. An answer the parser cannot read
gives ``None`` (the sample is skipped for this reward), is counted in ``num_unparsable`` and logged. A server that
fails or answers outside the chat-completions schema raises :class:`~trl_flow.rewards.remote.RemoteRewardError`.
"""

from __future__ import annotations

import logging
import os
import re
import string
import threading
from collections.abc import Callable, Sequence

from .base import check_images
from .remote import HTTPTransport, RemoteRewardError, _check_urls
from .threads import DaemonPool
from .wire import encode_images

logger = logging.getLogger(__name__)

DEFAULT_RUBRIC = (
    "You are judging an image generated from a text caption. Rate how faithfully the image shows everything the "
    "caption asks for (objects, counts, colours, positions, text) and its visual quality, on a scale from 0 "
    "(unrelated or broken) to 10 (perfect). Reply with a short justification, then a last line 'Score: N'.\n"
    "Caption: {prompt}"
)
#: A rubric for image edits: with ``source_image`` (an editing run) the judge gets the source image first, then the
#: edited one, then this text.
EDIT_RUBRIC = (
    "You are judging an image edit. The first image is the source, the second the result of the instruction below. "
    "Rate on a scale from 0 to 10: (a) whether the instruction was carried out completely and correctly (the "
    "requested objects, colours, positions, text, style), and (b) whether everything the instruction does not ask "
    "to change is left as in the source (identity, layout, background, lighting), and the result is free of "
    "artefacts. 0: the instruction is ignored or the image is broken; 5: the edit is done but other parts changed "
    "noticeably, or it is only partly done; 10: exactly the requested change and nothing else. Reply with a short "
    "justification, then a last line 'Score: N'.\n"
    "Instruction: {prompt}"
)
_NUMBER = r"(-?\d+(?:\.\d+)?)"
_DENOMINATOR = re.compile(r"\s*(?:/|\bout of\b|\bof\b)\s*\d+(?:\.\d+)?", re.I)  # "7/10", "7 out of 10"


class ScoreParser:
    """Read a score out of a judge's answer.

    The number after ``label`` (case-insensitive, e.g. ``Score: 7`` or ``Final Score = 4.5``, the last such
    occurrence), else the last number of the text once denominators ("/10", "out of 10") are dropped. Numbers
    outside ``[low, high]`` and answers without a number give None. ``output="unit"`` maps ``[low, high]`` to ``[0,
    1]``, ``"raw"`` returns the number.
    """

    def __init__(self, low: float = 0.0, high: float = 10.0, label: str | None = "score", output: str = "unit"):
        if not low < high:
            raise ValueError(f"ScoreParser: low={low} must be < high={high}")
        if output not in ("unit", "raw"):
            raise ValueError(f"ScoreParser: output={output!r} must be 'unit' or 'raw'")
        self.low, self.high, self.output = float(low), float(high), output
        self._label = re.compile(re.escape(label) + r"\s*[:=]?\s*\**\s*" + _NUMBER, re.I) if label else None

    def __call__(self, text: str) -> float | None:
        if not isinstance(text, str):
            return None
        found = self._label.findall(text) if self._label else []
        found = found or re.findall(_NUMBER, _DENOMINATOR.sub("", text))
        if not found:
            return None
        value = float(found[-1])
        if not self.low <= value <= self.high:
            return None
        return (value - self.low) / (self.high - self.low) if self.output == "unit" else value


class VLMJudgeReward:
    """A VLM judge served behind an OpenAI-compatible ``/v1/chat/completions`` endpoint.

    ```python
    # vllm serve Qwen/Qwen2.5-VL-7B-Instruct --port 8000
    judge = VLMJudgeReward("http://127.0.0.1:8000/v1", model="Qwen/Qwen2.5-VL-7B-Instruct")
    ```

    Args:
        url: the API base (``.../v1``) or the full ``.../chat/completions`` URL; a list is used round-robin.
        model: the served model name sent in each request.
        rubric: the text sent with each image; ``{prompt}`` and ``{<column>}`` placeholders are filled per sample.
        parser: ``answer text -> float | None`` (default :class:`ScoreParser` ``(0, 10)``, mapped to [0, 1]).
        api_key: sent as a bearer token (default: the ``OPENAI_API_KEY`` environment variable, if set).
        num_workers: requests in flight at once (the server batches them).
        max_tokens, temperature, system_prompt, extra_body: passed in the request (``extra_body`` is merged in).
    """

    def __init__(self, url: str | Sequence[str], model: str, rubric: str = DEFAULT_RUBRIC,
                 parser: Callable[[str], float | None] | None = None, name: str = "vlm_judge",
                 api_key: str | None = None, system_prompt: str | None = None, max_tokens: int = 256,
                 temperature: float = 0.0, timeout: float = 120.0, max_retries: int = 3, backoff: float = 1.0,
                 num_workers: int = 8, extra_body: dict | None = None):
        who = f"judge {name!r}"
        urls = [u if u.endswith("/chat/completions") else u + "/chat/completions" for u in _check_urls(url, who)]
        if not isinstance(rubric, str):
            raise TypeError(f"{who}: rubric must be a string with {{prompt}} / {{column}} placeholders")
        self.fields = [f for _, f, _, _ in string.Formatter().parse(rubric) if f]
        bad = [f for f in self.fields if not f.isidentifier()]
        if bad:
            raise ValueError(f"{who}: rubric placeholders {bad} are not names; use {{prompt}} or {{<column name>}} "
                             "(write {{ and }} for literal braces)")
        if parser is not None and not callable(parser):
            raise TypeError(f"{who}: parser must be a callable answer_text -> float | None")
        if not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"{who}: num_workers={num_workers!r} must be an integer >= 1")
        self.__name__ = name
        self.model, self.rubric, self.system_prompt = model, rubric, system_prompt
        self.parser = parser or ScoreParser()
        self.max_tokens, self.temperature, self.num_workers = max_tokens, temperature, num_workers
        self.extra_body = dict(extra_body or {})
        api_key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.transport = HTTPTransport(urls, "", who, timeout, max_retries, backoff, headers=headers)
        self.num_requests = 0
        self.num_unparsable = 0
        self.last_unparsable: str | None = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"VLMJudgeReward({self.transport.urls!r}, model={self.model!r}, name={self.__name__!r})"

    def messages(self, image_png_b64: str, prompt: str, row: dict, source_png_b64: str | None = None) -> list[dict]:
        """The chat messages for one sample (an editing run's source image, if any, before the generated one)."""
        try:
            text = self.rubric.format(prompt=prompt, **row)
        except KeyError as e:
            raise KeyError(f"judge {self.__name__!r}: rubric placeholder {e} is neither `prompt` nor a dataset column "
                           f"(have {sorted(row)})") from None
        content = [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64}"}}
                   for b64 in ((source_png_b64,) if source_png_b64 else ()) + (image_png_b64,)]
        content.append({"type": "text", "text": text})
        msgs = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return msgs + [{"role": "user", "content": content}]

    def _ask(self, image, prompt, row, source=None) -> tuple[float | None, str | None]:
        payload = {"model": self.model, "messages": self.messages(image, prompt, row, source),
                   "max_tokens": self.max_tokens,
                   "temperature": self.temperature, **self.extra_body}
        url, answer = self.transport.post(payload)
        try:
            text = answer["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise RemoteRewardError(f"judge {self.__name__!r}: {url} answered outside the chat-completions schema "
                                    f"(no choices[0].message.content): {str(answer)[:200]}") from None
        try:
            score = self.parser(text)
            score = None if score is None else float(score)
        except (ValueError, TypeError, ArithmeticError):
            score = None
        return score, text

    def __call__(self, images, prompts, **columns) -> list[float | None]:
        prompts = list(prompts)
        images = check_images(images, len(prompts), f"judge {self.__name__!r}")
        if images.ndim == 5:
            raise ValueError(f"judge {self.__name__!r} scores images, got video {tuple(images.shape)}; pass one "
                             "frame per sample (e.g. images[:, 0]) or score frames separately")
        encoded = encode_images(images)
        source = columns.pop("source_image", None)  # an editing run: the judge sees the source first
        sources = encode_images(check_images(source, len(prompts), f"judge {self.__name__!r} (source_image)")
                                ) if source is not None else [None] * len(prompts)
        rows = [{k: v[i] for k, v in columns.items()} for i in range(len(prompts))]
        with DaemonPool(min(self.num_workers, max(1, len(prompts))), "trl_flow-judge") as pool:
            results = pool.map(lambda args: self._ask(*args), zip(encoded, prompts, rows, sources))
        scores = [s for s, _ in results]
        bad = [t for s, t in results if s is None]
        with self._lock:
            self.num_requests += len(results)
            self.num_unparsable += len(bad)
            if bad:
                self.last_unparsable = bad[-1]
        if bad:
            logger.warning("%s: %d of %d answers had no readable score (skipped; %d of %d so far), e.g. %r",
                           self.__name__, len(bad), len(results), self.num_unparsable, self.num_requests,
                           str(bad[-1])[:200])
        return scores
