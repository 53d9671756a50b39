"""``trl-flow reward-server``: serve any reward callable over JSON/HTTP (FastAPI + uvicorn, extra ``serve``).

    trl-flow reward-server --reward pickscore --port 8001 --device cuda:0 --dtype bfloat16
    trl-flow reward-server --reward my_geneval:GenEvalReward --reward-kwargs '{"model_dir": "/models"}'
    python -m trl_flow.rewards.server --reward trl_flow.tasks.shapes:shapes_strict_reward

Endpoints and schema (version 1) are in :mod:`trl_flow.rewards.wire`; ``/docs`` shows them too. The server binds
127.0.0.1 unless told otherwise (it has no authentication: expose it only on a trusted network), rejects requests
over ``--max-request-mb`` (HTTP 413) before reading them whole, decodes only PNG images, and only when the
request's images hold at most ``--max-request-pixels`` pixels in all (checked on the PNG headers; HTTP 413
otherwise: that bounds its memory per request), and runs one reward call at a time. Nothing is unpickled or
evaluated: requests are JSON, the reward is chosen by name or imported by ``module:callable``, its keyword
arguments are JSON.
"""

# No `from __future__ import annotations`: FastAPI reads the endpoint annotations at runtime.
import argparse
import json
import logging
import math
import threading
from typing import Any

from .wire import MAX_IMAGE_PIXELS, MAX_REQUEST_PIXELS, SCHEMA_VERSION, TooManyPixels, decode_request

logger = logging.getLogger(__name__)
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _require_serve():
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise ImportError("the reward server needs FastAPI and uvicorn: pip install 'trl_flow[serve]'") from None


def build_app(reward, name: str | None = None, max_request_bytes: int = 64 * 2**20,
              max_image_pixels: int = MAX_IMAGE_PIXELS, max_request_pixels: int = MAX_REQUEST_PIXELS):
    """The FastAPI app serving ``reward`` at ``POST /score`` and ``GET /health``. A request is refused (HTTP 413)
    over ``max_request_bytes`` of body or ``max_request_pixels`` pixels in all its images (every frame counted,
    read from the PNG headers before any decoding); an image over ``max_image_pixels`` is refused (HTTP 400)."""
    for arg, v in (("max_request_bytes", max_request_bytes), ("max_image_pixels", max_image_pixels),
                   ("max_request_pixels", max_request_pixels)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"build_app: {arg}={v!r} must be an integer >= 1")
    _require_serve()
    from fastapi import FastAPI, HTTPException, Request
    from pydantic import BaseModel, ConfigDict, Field, ValidationError
    from starlette.concurrency import run_in_threadpool

    from .core import call_scores, reward_name

    if not callable(reward):
        raise TypeError(f"build_app: reward {reward!r} is not callable")
    name = name or reward_name(reward)

    class ScoreRequest(BaseModel):
        model_config = ConfigDict(extra="forbid")
        schema_version: int = Field(description=f"Must be {SCHEMA_VERSION}.")
        images: list[str] | list[list[str]] = Field(description="One base64 PNG per sample, or per sample a list of "
                                                                "frame PNGs (video); all of the same size.")
        prompts: list[str] = Field(description="One prompt per sample.")
        columns: dict[str, list[Any]] = Field(default_factory=dict, description="Other dataset columns, one JSON "
                                                                                "value per sample.")
        source_images: list[str] | None = Field(default=None, description="An editing run's source images, one "
                                                "base64 PNG per sample (the reward's `source_image=`).")

    class ScoreResponse(BaseModel):
        schema_version: int
        reward: str
        scores: list[float | None] = Field(description="One score per sample; null = no score.")

    app = FastAPI(title="trl_flow reward server", version=str(SCHEMA_VERSION),
                  description=f"Serves the reward `{name}`. Schema version {SCHEMA_VERSION}.")
    lock = threading.Lock()

    def run_reward(images, prompts, columns):
        with lock:  # one call at a time: reward models are rarely thread-safe, and a GPU gains nothing
            try:
                out = reward(images, prompts, **columns)
            except Exception as e:
                raise RuntimeError(f"reward function {name!r} raised {type(e).__name__}: {e}") from e
        return [None if math.isnan(v) else v for v in call_scores(out, len(prompts), name)]  # NaN/inf -> null

    @app.get("/health")
    def health():
        return {"status": "ok", "schema_version": SCHEMA_VERSION, "reward": name}

    @app.post("/score", response_model=ScoreResponse, openapi_extra={"requestBody": {
        "required": True, "content": {"application/json": {"schema": ScoreRequest.model_json_schema()}}}})
    async def score(request: Request):
        too_big = (f"request over the limit of {max_request_bytes} bytes; send smaller batches "
                   "(RemoteReward(batch_size=...)) or start the server with a larger --max-request-mb")
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > max_request_bytes):
            raise HTTPException(413, too_big)
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > max_request_bytes:
                raise HTTPException(413, too_big)
        try:
            req = ScoreRequest.model_validate_json(bytes(body))
        except ValidationError as e:
            raise HTTPException(422, [{"loc": err["loc"], "msg": err["msg"]} for err in e.errors()]) from None
        if req.schema_version != SCHEMA_VERSION:
            raise HTTPException(400, f"schema_version {req.schema_version} is not supported; this server speaks "
                                     f"{SCHEMA_VERSION} (use the same trl_flow version on both sides)")
        n = len(req.prompts)
        if len(req.images) != n:
            raise HTTPException(422, f"got {len(req.images)} images for {n} prompts")
        for k, v in req.columns.items():
            if len(v) != n:
                raise HTTPException(422, f"column {k!r} has {len(v)} values for {n} prompts")
        if req.source_images is not None and len(req.source_images) != n:
            raise HTTPException(422, f"got {len(req.source_images)} source_images for {n} prompts")
        if "source_image" in req.columns:
            raise HTTPException(422, "column 'source_image': send the source images as `source_images` (PNGs)")
        try:
            images, sources = decode_request(req.images, req.source_images, max_image_pixels, max_request_pixels)
        except TooManyPixels as e:
            raise HTTPException(413, str(e)) from None
        except ValueError as e:
            raise HTTPException(400, str(e)) from None
        columns = req.columns if sources is None else {**req.columns, "source_image": sources}
        try:
            scores = await run_in_threadpool(run_reward, images, req.prompts, columns)
        except RuntimeError as e:  # names the reward and the error
            logger.exception("reward %s failed", name)
            raise HTTPException(500, str(e)) from None
        return {"schema_version": SCHEMA_VERSION, "reward": name, "scores": scores}

    return app


def build_arg_parser(prog: str = "trl-flow reward-server") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Serve a trl_flow reward over JSON/HTTP (schema version "
                                f"{SCHEMA_VERSION}, see docs/rewards.md).")
    p.add_argument("--reward", required=True,
                   help="A registered reward name (pickscore, clip_score, aesthetic, hpsv2, image_reward, ocr, "
                        "shapes_strict, ...) or a dotted path module:callable (a class is instantiated).")
    p.add_argument("--reward-kwargs", default="{}",
                   help="JSON object of keyword arguments for the reward's factory or class.")
    p.add_argument("--name", default=None, help="Name reported to clients (default: the reward's name).")
    p.add_argument("--host", default="127.0.0.1",
                   help="Address to bind (default 127.0.0.1). The server has no authentication: bind a public "
                        "address only on a trusted network.")
    p.add_argument("--port", type=int, default=8000, help="Port (default 8000).")
    p.add_argument("--device", default=None, help="Device of a reward model (e.g. cuda:0; default: cpu).")
    p.add_argument("--dtype", default=None, help="dtype of a reward model: float32, bfloat16 or float16.")
    p.add_argument("--max-request-mb", type=float, default=64.0, help="Largest accepted request body in MiB.")
    p.add_argument("--max-request-pixels", type=int, default=MAX_REQUEST_PIXELS,
                   help=f"Most pixels a request's images may hold in all, every video frame counted (default "
                        f"{MAX_REQUEST_PIXELS} = 32 images of 1024x1024); checked on the PNG headers before decoding, "
                        "a larger request is refused with HTTP 413. Bounds the server's memory per request: about 21 "
                        "bytes per pixel.")
    p.add_argument("--log-level", default="info", help="uvicorn log level.")
    return p


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``trl-flow reward-server`` and ``python -m trl_flow.rewards.server``."""
    args = build_arg_parser().parse_args(argv)
    _require_serve()
    import uvicorn

    from .registry import get_reward

    try:
        kwargs = json.loads(args.reward_kwargs)
    except ValueError as e:
        raise SystemExit(f"--reward-kwargs: not valid JSON ({e})") from None
    if not isinstance(kwargs, dict):
        raise SystemExit("--reward-kwargs: must be a JSON object, e.g. '{\"batch_size\": 16}'")
    if args.max_request_mb <= 0:
        raise SystemExit("--max-request-mb: must be > 0")
    if args.max_request_pixels < 1:
        raise SystemExit(f"--max-request-pixels {args.max_request_pixels}: must be an integer >= 1")
    reward = get_reward(args.reward, **kwargs)
    if args.device or args.dtype:
        if not hasattr(reward, "prepare"):
            raise SystemExit(f"--device/--dtype: reward {args.reward!r} has no prepare(device, dtype); pass them in "
                             "--reward-kwargs if it takes them")
        reward.prepare(args.device, args.dtype)
    if callable(getattr(reward, "load", None)):  # a reward model: load the weights now, not at the first request
        reward.load()
    if args.host not in LOOPBACK:
        logger.warning("binding %s: the reward server has no authentication; anyone who can reach this address "
                       "can use it", args.host)
    app = build_app(reward, args.name, max_request_bytes=int(args.max_request_mb * 2**20),
                    max_request_pixels=args.max_request_pixels)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)


if __name__ == "__main__":
    main()
