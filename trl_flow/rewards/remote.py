"""Rewards computed by a server: :class:`RemoteReward` for ``trl-flow reward-server`` (any reward callable served
over JSON/HTTP, see :mod:`trl_flow.rewards.wire`), and the HTTP transport it shares with the VLM judge.

The transport sends one request per batch, round-robin over the given servers, retries connection errors,
timeouts and HTTP 408/429/502/503/504 on the next server with exponential backoff, and raises
:class:`RemoteRewardError` naming the URLs when no server answers. An answer that is malformed (not JSON, wrong
schema, wrong length) or an HTTP error of the reward itself (4xx, 500) is raised at once, naming the URL; it never
becomes a silent zero.
"""

from __future__ import annotations

import http.client
import itertools
import json
import math
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence

from .base import check_images
from .threads import DaemonPool
from .wire import SCHEMA_VERSION, encode_images, parse_scores

RETRYABLE_STATUS = frozenset({408, 429, 502, 503, 504})


class RemoteRewardError(RuntimeError):
    """A reward server (or judge endpoint) failed, stayed down or answered something unusable."""


def _check_urls(url, who: str) -> list[str]:
    urls = [url] if isinstance(url, str) else list(url)
    if not urls:
        raise ValueError(f"{who}: url: give a URL or a non-empty list of URLs")
    for u in urls:
        if not isinstance(u, str) or not u.startswith(("http://", "https://")):
            raise ValueError(f"{who}: url {u!r} must start with http:// or https://")
    return [u.rstrip("/") for u in urls]


def _detail(body: bytes) -> str:
    try:
        return str(json.loads(body).get("detail"))[:500]
    except (ValueError, AttributeError):
        return body[:200].decode("utf-8", "replace")


class HTTPTransport:
    """POST JSON to one of several servers with timeouts, retries, backoff and round-robin.

    Args:
        urls: base URLs; ``path`` is appended to each.
        timeout: seconds per request (connect + answer).
        max_retries: further attempts after the first, each on the next server.
        backoff: seconds before the first retry, doubled at each further one (at most 30 s).
    """

    def __init__(self, urls: list[str], path: str, who: str, timeout: float = 120.0, max_retries: int = 3,
                 backoff: float = 1.0, headers: dict | None = None):
        if not (timeout > 0 and math.isfinite(timeout)):
            raise ValueError(f"{who}: timeout={timeout!r} must be a positive number of seconds")
        if not isinstance(max_retries, int) or max_retries < 0:
            raise ValueError(f"{who}: max_retries={max_retries!r} must be an integer >= 0")
        if not backoff >= 0:
            raise ValueError(f"{who}: backoff={backoff!r} must be >= 0 seconds")
        self.urls, self.path, self.who = urls, path, who
        self.timeout, self.max_retries, self.backoff = float(timeout), max_retries, float(backoff)
        self.headers = {"Content-Type": "application/json", **(headers or {})}
        self._next = itertools.count()
        self._lock = threading.Lock()

    def next_start(self) -> int:
        with self._lock:
            return next(self._next)

    def request(self, url: str, payload=None) -> tuple[int, bytes]:
        """One request (GET without payload, else POST): (status, body). Network errors propagate."""
        data = None if payload is None else json.dumps(payload, allow_nan=False).encode()
        req = urllib.request.Request(url, data=data, method="GET" if data is None else "POST", headers=self.headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def post(self, payload, start: int | None = None) -> tuple[str, object]:
        """POST ``payload``; returns (the URL that answered, its JSON answer)."""
        start = self.next_start() if start is None else start
        errors = []
        for attempt in range(self.max_retries + 1):
            url = self.urls[(start + attempt) % len(self.urls)] + self.path
            if attempt:
                time.sleep(min(self.backoff * 2 ** (attempt - 1), 30.0))
            try:
                status, body = self.request(url, payload)
            except (urllib.error.URLError, http.client.HTTPException, OSError) as e:  # refused, reset, timeout
                errors.append(f"{url}: {getattr(e, 'reason', None) or e}")
                continue
            if status in RETRYABLE_STATUS:
                errors.append(f"{url}: HTTP {status} {_detail(body)}")
                continue
            if status >= 400:
                raise RemoteRewardError(f"{self.who}: {url} answered HTTP {status}: {_detail(body)}")
            try:
                return url, json.loads(body)
            except ValueError:
                raise RemoteRewardError(f"{self.who}: {url} answered malformed JSON: {body[:200]!r}") from None
        raise RemoteRewardError(
            f"{self.who}: no answer after {self.max_retries + 1} attempt(s) over {self.urls}; is the server "
            f"running and reachable? Errors: {'; '.join(errors)}"
        )


class RemoteReward:
    """A reward served by ``trl-flow reward-server`` (or anything speaking :mod:`trl_flow.rewards.wire`).

    ```python
    reward = RemoteReward(["http://127.0.0.1:8001", "http://127.0.0.1:8002"], name="geneval", batch_size=32)
    trainer = FlowGRPOTrainer(config, pipe, [reward], train_dataset=prompts)
    ```

    Args:
        url: one server URL or a list, used round-robin (batches go to the servers in parallel).
        name: the name the reward is logged under.
        batch_size: images per request.
        columns: dataset columns to send (default all); each value must be JSON-serialisable. An editing run's
            ``source_image`` (B, 3, H, W) is not a column: it is always sent, as PNGs (``source_images``), and the
            served reward gets it as its ``source_image=`` (8-bit, as the images).
        timeout, max_retries, backoff: see :class:`HTTPTransport`.
    """

    def __init__(self, url: str | Sequence[str], name: str = "remote", batch_size: int = 16,
                 timeout: float = 120.0, max_retries: int = 3, backoff: float = 1.0,
                 columns: Sequence[str] | None = None):
        self.urls = _check_urls(url, f"RemoteReward({name!r})")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"RemoteReward: batch_size={batch_size!r} must be an integer >= 1")
        self.__name__ = name
        self.batch_size = batch_size
        self.columns = None if columns is None else list(columns)
        self.transport = HTTPTransport(self.urls, "/score", f"reward {name!r}", timeout, max_retries, backoff)

    #: The options a URL may carry in its query string (see :meth:`from_url`): name -> (type, check, what it needs).
    URL_OPTIONS = {
        "timeout": (float, lambda v: v > 0 and math.isfinite(v), "a positive number of seconds"),
        "max_retries": (int, lambda v: v >= 0, "an integer >= 0"),
        "backoff": (float, lambda v: v >= 0 and math.isfinite(v), "a number of seconds >= 0"),
        "batch_size": (int, lambda v: v >= 1, "an integer >= 1"),
        "name": (str, bool, "a non-empty string"),
    }

    @classmethod
    def from_url(cls, spec: str) -> RemoteReward:
        """A :class:`RemoteReward` from one URL whose query string sets its options, the form command lines and
        recipes use (``--reward_funcs``)::

            http://127.0.0.1:8001?timeout=30&max_retries=5&backoff=2&batch_size=8&name=geneval

        Options: ``timeout`` (seconds per request, default 120), ``max_retries`` (3), ``backoff`` (seconds, 1),
        ``batch_size`` (16), ``name`` ("remote"). An unknown option or a bad value is a ``ValueError`` naming it."""
        parts = urllib.parse.urlsplit(spec)
        if parts.fragment:
            raise ValueError(f"reward URL {spec!r}: remove the '#{parts.fragment}' part; options go in the query "
                             "string, e.g. ?timeout=30&max_retries=5")
        pairs = [kv.partition("=") for kv in parts.query.split("&")] if parts.query or spec.endswith("?") else []
        if any(not key or not eq for key, eq, _ in pairs):
            raise ValueError(f"reward URL {spec!r}: the query string must be key=value pairs joined by '&', e.g. "
                             "?timeout=30&max_retries=5")
        kwargs = {}
        for key, _, raw in pairs:
            raw = urllib.parse.unquote_plus(raw)
            if key not in cls.URL_OPTIONS:
                raise ValueError(f"reward URL {spec!r}: unknown option {key!r}; the options are "
                                 f"{', '.join(cls.URL_OPTIONS)} (e.g. ?timeout=30&max_retries=5&backoff=2)")
            if key in kwargs:
                raise ValueError(f"reward URL {spec!r}: option {key!r} is given twice")
            kind, ok, need = cls.URL_OPTIONS[key]
            try:
                value = kind(raw)
                good = ok(value)
            except ValueError:
                good = False
            if not good:
                raise ValueError(f"reward URL {spec!r}: {key}={raw!r} must be {need}")
            kwargs[key] = value
        base = urllib.parse.urlunsplit((parts.scheme, parts.netloc, parts.path, "", ""))
        return cls(base, **kwargs)

    def __repr__(self) -> str:
        return f"RemoteReward({self.urls!r}, name={self.__name__!r})"

    def health(self) -> list[dict]:
        """``GET /health`` of every server (raises naming the first that does not answer)."""
        out = []
        for u in self.urls:
            try:
                status, body = self.transport.request(u + "/health")
                ans = json.loads(body)
            except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as e:
                raise RemoteRewardError(f"reward {self.__name__!r}: {u}/health failed: {e}") from None
            if status != 200 or ans.get("schema_version") != SCHEMA_VERSION:
                raise RemoteRewardError(f"reward {self.__name__!r}: {u}/health answered HTTP {status}: {ans}")
            out.append(ans)
        return out

    def _columns(self, columns: dict, n: int) -> dict[str, list]:
        names = [k for k in (list(columns) if self.columns is None else self.columns) if k != "source_image"]
        out = {}
        for k in names:
            if k not in columns:
                raise KeyError(f"reward {self.__name__!r}: column {k!r} is not a dataset column "
                               f"(have {sorted(columns)})")
            vals = list(columns[k])
            try:
                json.dumps(vals, allow_nan=False)
            except (TypeError, ValueError) as e:
                raise TypeError(f"reward {self.__name__!r}: column {k!r} is not JSON-serialisable ({e}); choose the "
                                "columns to send with RemoteReward(columns=[...])") from None
            out[k] = vals
        return out

    def __call__(self, images, prompts, **columns) -> list[float | None]:
        prompts = list(prompts)
        n = len(prompts)
        images = check_images(images, n, f"reward {self.__name__!r}")
        source = columns.pop("source_image", None)  # an editing run: sent as PNGs, not as a JSON column
        cols = self._columns(columns, n)
        encoded = encode_images(images)
        sources = None
        if source is not None:
            source = check_images(source, n, f"reward {self.__name__!r} (source_image)")
            if source.ndim != 4:
                raise ValueError(f"reward {self.__name__!r}: source_image must be (B, 3, H, W), got "
                                 f"{tuple(source.shape)}")
            sources = encode_images(source)
        spans = [(lo, min(lo + self.batch_size, n)) for lo in range(0, n, self.batch_size)]
        start = self.transport.next_start()

        def send(i):
            lo, hi = spans[i]
            payload = {"schema_version": SCHEMA_VERSION, "images": encoded[lo:hi], "prompts": prompts[lo:hi],
                       "columns": {k: v[lo:hi] for k, v in cols.items()}}
            if sources is not None:
                payload["source_images"] = sources[lo:hi]
            url, answer = self.transport.post(payload, start=start + i)
            try:
                return parse_scores(answer, hi - lo, url)
            except ValueError as e:
                raise RemoteRewardError(f"reward {self.__name__!r}: {e}") from None

        if len(spans) <= 1:
            results = [send(i) for i in range(len(spans))]
        else:
            with DaemonPool(min(len(spans), len(self.urls)), "trl_flow-remote") as pool:
                results = pool.map(send, range(len(spans)))
        return [s for r in results for s in r]
