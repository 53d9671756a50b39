"""Remote rewards for real on loopback: the reward server (uvicorn, in a thread and as a subprocess) and
RemoteReward, the VLM judge against a small local server speaking the OpenAI chat-completions schema, and servers
that fail or answer garbage."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import math
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch

from trl_flow.rewards import RemoteReward, RemoteRewardError, ScoreParser, VLMJudgeReward
from trl_flow.rewards.server import build_app, build_arg_parser
from trl_flow.rewards.wire import decode_images, encode_images

uvicorn = pytest.importorskip("uvicorn")  # in the `test` extra; only skipped where the extra is not installed


# ------------------------------------------------------------------------------------------------- servers
@contextlib.contextmanager
def serve_app(app):
    """Run a FastAPI app with uvicorn on 127.0.0.1 (free port) in a thread; yields its URL."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(2000):
        if server.started or not thread.is_alive():
            break
        time.sleep(0.01)
    assert server.started, "uvicorn did not start"
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@contextlib.contextmanager
def serve_handler(respond):
    """A stdlib HTTP server on 127.0.0.1: ``respond(path, json_body, headers) -> (status, bytes)``; yields
    (url, list of received (path, body, headers))."""
    seen = []

    class Handler(BaseHTTPRequestHandler):
        def _answer(self, body):
            seen.append((self.path, body, dict(self.headers)))
            status, out = respond(self.path, body, self.headers)
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def do_POST(self):
            self._answer(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))

        def do_GET(self):
            self._answer(None)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", seen
    finally:
        httpd.shutdown()
        httpd.server_close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _quantised(images):
    return (images.clamp(0, 1) * 255).round() / 255


def brightness_plus(images, prompts, offset=None, **columns):
    """Mean pixel + prompt length (+ the `offset` column); NaN for the prompt "skip"."""
    dims = tuple(range(1, images.ndim))
    out = images.mean(dim=dims) + torch.tensor([float(len(p)) for p in prompts])
    if offset is not None:
        out = out + torch.tensor(offset, dtype=torch.float32)
    return [float("nan") if p == "skip" else float(v) for p, v in zip(prompts, out)]


IMAGES = torch.rand(7, 3, 16, 12, generator=torch.Generator().manual_seed(0))
PROMPTS = ["a", "bb", "skip", "dddd", "e", "ff", "ggg"]


# ------------------------------------------------------------------------------------------- server + client
def test_wire_roundtrip_is_exact_on_8_bit_images():
    video = torch.rand(2, 3, 3, 8, 8)
    assert torch.equal(decode_images(encode_images(IMAGES)), _quantised(IMAGES))
    assert torch.equal(decode_images(encode_images(video)), _quantised(video))
    with pytest.raises(ValueError, match=r"images\[1\]: not a base64 PNG"):
        decode_images([encode_images(IMAGES[:1])[0], "@@@"])
    with pytest.raises(ValueError, match="same size"):
        decode_images(encode_images(IMAGES[:1]) + encode_images(torch.rand(1, 3, 4, 4)))
    with pytest.raises(ValueError, match="over the limit"):
        decode_images(encode_images(IMAGES[:1]), max_pixels=100)


def test_remote_reward_matches_the_local_reward_batched_and_round_robin():
    counts = {}

    def counted(tag):
        def reward(images, prompts, **columns):
            counts[tag] = counts.get(tag, 0) + 1
            return brightness_plus(images, prompts, **columns)

        reward.__name__ = "brightness_plus"
        return reward

    offsets = [0.5 * i for i in range(7)]
    expected = brightness_plus(_quantised(IMAGES), PROMPTS, offset=offsets)
    with serve_app(build_app(counted("a"))) as url_a, serve_app(build_app(counted("b"))) as url_b:
        one = RemoteReward(url_a, name="bright", batch_size=3)
        got = one(IMAGES, PROMPTS, offset=offsets)
        assert got[2] is None  # NaN on the server -> null -> None
        assert np.allclose([g for g in got if g is not None], [e for e in expected if not math.isnan(e)], atol=1e-6)
        assert counts == {"a": 3}  # 7 images in batches of 3
        two = RemoteReward([url_a, url_b], batch_size=2)
        assert two(IMAGES, PROMPTS, offset=offsets) == got
        assert counts == {"a": 5, "b": 2}  # 4 batches, round-robin over the two servers
        assert [h["reward"] for h in two.health()] == ["brightness_plus"] * 2
        # video (B, F, 3, H, W) goes as lists of frame PNGs
        video = torch.rand(2, 3, 3, 8, 8)
        assert np.allclose(one(video, ["a", "b"]), brightness_plus(_quantised(video), ["a", "b"]), atol=1e-6)
        # only the chosen columns are sent; a column that is not JSON is named
        assert RemoteReward(url_a, columns=[])(IMAGES[:2], ["a", "b"], offset=[1, 2], other=[object(), 1])
        with pytest.raises(TypeError, match="column 'other' is not JSON-serialisable"):
            one(IMAGES[:2], ["a", "b"], other=[object(), 1])


def test_server_rejects_bad_requests_with_clear_errors():
    def raising(images, prompts, **c):
        raise ValueError("detector weights missing")

    with serve_app(build_app(brightness_plus, max_request_bytes=4000)) as url, serve_app(build_app(raising)) as bad:
        small = RemoteReward(url, batch_size=64)
        with pytest.raises(RemoteRewardError, match=r"127\.0\.0\.1.*HTTP 413.*limit of 4000 bytes"):
            small(torch.rand(8, 3, 32, 32), ["x"] * 8)
        assert len(small(IMAGES[:1], ["x"])) == 1
        t = small.transport
        ok = encode_images(IMAGES[:2])
        for payload, status, text in [
            ({"schema_version": 2, "images": ok, "prompts": ["a", "b"]}, 400, "schema_version 2"),
            ({"schema_version": 1, "images": ok, "prompts": ["a"]}, 422, "2 images for 1 prompts"),
            ({"schema_version": 1, "images": ok, "prompts": ["a", "b"], "columns": {"c": [1]}}, 422, "column 'c'"),
            ({"schema_version": 1, "images": [ok[0], "bm90IGEgcG5n"], "prompts": ["a", "b"]}, 400, "images[1]"),
            ({"schema_version": 1, "prompts": ["a"]}, 422, "images"),
            ({"schema_version": 1, "images": ok, "prompts": ["a", "b"], "pickle": "x"}, 422, "pickle"),
        ]:
            code, body = t.request(url + "/score", payload)
            assert code == status and text in json.dumps(json.loads(body)["detail"]), (payload.keys(), body)
        with pytest.raises(RemoteRewardError, match=r"HTTP 500: reward function 'raising' raised ValueError: "
                                                    r"detector weights missing"):
            RemoteReward(bad, max_retries=0)(IMAGES[:1], ["x"])


def test_client_retries_fails_over_and_names_the_url():
    dead = f"http://127.0.0.1:{_free_port()}"
    with serve_app(build_app(brightness_plus)) as live:
        # a dead server first: the batch is retried on the next server
        r = RemoteReward([dead, live], batch_size=7, max_retries=1, backoff=0.01)
        assert len(r(IMAGES, PROMPTS)) == 7
    with pytest.raises(RemoteRewardError, match=rf"no answer after 3 attempt\(s\).*{dead}.*running"):
        RemoteReward(dead, max_retries=2, backoff=0.01)(IMAGES[:2], ["a", "b"])

    modes = iter(["503", "ok"])

    def flaky(path, body, headers):
        if next(modes) == "503":
            return 503, b'{"detail": "busy"}'
        return 200, json.dumps({"schema_version": 1, "reward": "x", "scores": [1.0, 2.0]}).encode()

    with serve_handler(flaky) as (url, seen):
        assert RemoteReward(url, backoff=0.01)(IMAGES[:2], ["a", "b"]) == [1.0, 2.0]
        assert len(seen) == 2  # 503 retried once


@pytest.mark.parametrize("status,answer,message", [
    (200, b"<html>not json</html>", "malformed JSON"),
    (200, json.dumps({"schema_version": 1, "scores": [1.0]}).encode(), "answered 1 scores for 2 images"),
    (200, json.dumps({"schema_version": 1, "scores": [1.0, "high"]}).encode(), "non-numeric score 'high'"),
    (200, json.dumps({"schema_version": 7, "scores": [1.0, 2.0]}).encode(), "schema_version 7"),
    (200, json.dumps([1.0, 2.0]).encode(), "expected a JSON object"),
    (500, b'{"detail": "CUDA out of memory"}', "HTTP 500: CUDA out of memory"),
])
def test_a_malformed_answer_is_an_error_naming_the_server(status, answer, message):
    with serve_handler(lambda p, b, h: (status, answer)) as (url, seen):
        with pytest.raises(RemoteRewardError, match=message) as err:
            RemoteReward(url, backoff=0.01)(IMAGES[:2], ["a", "b"])
        assert url in str(err.value)
        assert len(seen) == 1  # not retried: a broken answer is not a transient failure


@pytest.mark.slow
def test_reward_server_command_serves_the_shapes_detector():
    """The GenEval pattern on the shapes task: `python -m trl_flow.rewards.server --reward module:callable` in its
    own process, scored through RemoteReward == the detector called locally."""
    from trl_flow.tasks import shapes

    port = _free_port()
    cmd = [sys.executable, "-m", "trl_flow.rewards.server", "--reward", "trl_flow.tasks.shapes:shapes_strict_reward",
           "--port", str(port), "--log-level", "warning"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    try:
        reward = RemoteReward(f"http://127.0.0.1:{port}", name="shapes_remote", batch_size=4, max_retries=0)
        for _ in range(1200):  # wait for the server to come up
            try:
                assert reward.health()[0]["reward"] == "shapes_strict"
                break
            except RemoteRewardError:
                assert proc.poll() is None, proc.stdout.read().decode()
                time.sleep(0.05)
        rows = shapes.train_prompts()[:10]
        images = shapes.render_batch(rows["prompt"], rng=0)
        images[1::3] = torch.rand(len(images[1::3]), 3, 32, 32, generator=torch.Generator().manual_seed(1))
        local = shapes.shapes_strict_reward(images, rows["prompt"])
        assert reward(images, rows["prompt"], category=rows["category"]) == local
        assert 0 < sum(local) < len(local)  # both outcomes present
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_a_served_editing_reward_receives_the_same_sources():
    """An editing run's source_image (B, 3, H, W) goes to the server as PNGs (`source_images`, split with the
    batches) and reaches the served reward as its source_image= exactly (8-bit values), whatever columns are
    chosen; the scores equal the reward called locally. A wrong count is refused (422), the pixel limit counts
    the sources too (413), and a `source_image` JSON column is refused."""
    from trl_flow.rewards import edit_preservation

    received = []

    def recording(images, prompts, source_image=None, **columns):
        received.append((list(prompts), source_image))
        if source_image is None:
            return [0.0] * len(prompts)
        return edit_preservation()(images, prompts, source_image=source_image)

    recording.__name__ = "recording"
    sources = _quantised(torch.rand(7, 3, 16, 12, generator=torch.Generator().manual_seed(3)))
    local = edit_preservation()(_quantised(IMAGES), PROMPTS, source_image=sources)
    with serve_app(build_app(recording)) as url, serve_app(
        build_app(brightness_plus, max_request_pixels=600)) as small:
        got = RemoteReward(url, batch_size=3, columns=[])(IMAGES, PROMPTS, source_image=sources)
        assert np.allclose(got, local, atol=1e-6)
        assert [p for p, _ in received] == [PROMPTS[:3], PROMPTS[3:6], PROMPTS[6:]]
        assert torch.equal(torch.cat([s for _, s in received]), sources)
        received.clear()
        RemoteReward(url)(IMAGES[:2], PROMPTS[:2])  # a text-to-image run sends none
        assert received[0][1] is None
        t = RemoteReward(url).transport
        ok = encode_images(IMAGES[:2])
        for payload, status, text in [
            ({"schema_version": 1, "images": ok, "prompts": ["a", "b"], "source_images": ok[:1]}, 422,
             "1 source_images for 2 prompts"),
            ({"schema_version": 1, "images": ok, "prompts": ["a", "b"], "columns": {"source_image": [1, 2]}}, 422,
             "send the source images as `source_images`"),
            ({"schema_version": 1, "images": ok, "prompts": ["a", "b"], "source_images": [ok[0], "@@"]}, 400,
             "source_images[1]: not a base64 PNG"),
        ]:
            code, body = t.request(url + "/score", payload)
            assert code == status and text in json.dumps(json.loads(body)["detail"]), body
        assert len(RemoteReward(small)(IMAGES[:3], PROMPTS[:3])) == 3  # 576 pixels: under the limit
        with pytest.raises(RemoteRewardError, match=r"HTTP 413.*3 images and 3 source images has 1152 pixels"):
            RemoteReward(small)(IMAGES[:3], PROMPTS[:3], source_image=sources[:3])


def test_an_editing_run_scores_through_a_served_reward(tmp_path):
    """A trainer on an editing dataset (tiny FLUX.1 Kontext) with a served reward: the server's reward gets, for
    every sample, the same source_image as a local reward of the same run."""
    from datasets import Dataset
    from PIL import Image

    from trl_flow import FlowGRPOConfig, FlowGRPOTrainer
    from trl_flow.models.flux_kontext import FluxKontextAdapter
    from trl_flow.testing import tiny_flux_kontext_pipeline

    paths = []
    for i in range(2):
        paths.append(str(tmp_path / f"src{i}.png"))
        Image.fromarray(np.random.default_rng(i).integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(paths[-1])
    dataset = Dataset.from_dict({"prompt": ["make it red", "add a dog"], "source_image": paths})
    local, served = [], []

    def recorder(into, name):
        def reward(images, prompts, source_image=None, **columns):
            into.extend(zip(prompts, source_image))
            return [0.0] * len(prompts)

        reward.__name__ = name
        return reward

    config = FlowGRPOConfig(output_dir=str(tmp_path / "out"), max_steps=1, num_generations=2, prompts_per_step=2,
                            per_device_train_batch_size=2, height=32, width=32, max_sequence_length=16,
                            num_inference_steps=2, guidance_scale=2.5, lora_r=4, lora_alpha=8, disable_tqdm=True)
    with serve_app(build_app(recorder(served, "served"))) as url:
        trainer = FlowGRPOTrainer(config, FluxKontextAdapter(tiny_flux_kontext_pipeline(), source_size="source"),
                                  [recorder(local, "local"), RemoteReward(url, batch_size=3)], train_dataset=dataset)
        trainer.train()
    assert len(served) == len(local) == 2 + 4  # the start-up check, then the iteration's 4 samples
    for (p1, s1), (p2, s2) in zip(local, served):
        assert p1 == p2 and torch.equal(s1, s2)


def test_server_arg_parser_defaults_to_loopback():
    args = build_arg_parser().parse_args(["--reward", "pickscore"])
    assert args.host == "127.0.0.1" and args.reward_kwargs == "{}" and args.max_request_mb == 64.0


# ------------------------------------------------------------------------------------------------ VLM judge
def _chat_answer(text):
    return 200, json.dumps({"id": "x", "object": "chat.completion", "model": "judge",
                            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                         "finish_reason": "stop"}]}).encode()


def test_vlm_judge_against_a_local_openai_schema_server(caplog):
    answers = {"cat": "Clear cat, good light.\nScore: 8", "dog": "Final score = 3.5 overall",
               "sky": "I cannot judge this image.", "car": "Score: 42", "sun": "**Score:** 10"}

    def respond(path, body, headers):
        assert path == "/v1/chat/completions"
        assert headers["Authorization"] == "Bearer secret"
        assert body["model"] == "judge-vl" and body["temperature"] == 0.0
        image_part, text_part = body["messages"][-1]["content"]
        assert image_part["image_url"]["url"].startswith("data:image/png;base64,")
        caption = text_part["text"].split("Caption: ")[1]
        return _chat_answer(answers[caption.split()[-1]])

    prompts = ["a cat", "a dog", "green sky", "red car", "the sun"]
    images = torch.rand(5, 3, 8, 8)
    with serve_handler(respond) as (url, seen):
        judge = VLMJudgeReward(url + "/v1", model="judge-vl", api_key="secret", num_workers=3,
                               rubric="Rate it.\nCaption: {prompt}")
        with caplog.at_level("WARNING", logger="trl_flow.rewards.judge"):
            scores = judge(images, prompts)
        assert scores == [0.8, 0.35, None, None, 1.0]  # no number / out of [0, 10] -> None
        sent = base64.b64decode(seen[0][1]["messages"][-1]["content"][0]["image_url"]["url"].split(",")[1])
        from PIL import Image

        assert Image.open(io.BytesIO(sent)).format == "PNG"
    assert judge.num_unparsable == 2 and judge.num_requests == 5
    assert "2 of 5 answers had no readable score" in caplog.text


def test_vlm_judge_rubric_columns_parser_and_server_errors():
    def respond(path, body, headers):
        text = body["messages"][-1]["content"][1]["text"]
        assert body["messages"][0] == {"role": "system", "content": "be strict"}
        return _chat_answer(f"Final Score: {text.count('x')}")

    with serve_handler(respond) as (url, _):
        judge = VLMJudgeReward(url + "/v1/chat/completions", model="m", system_prompt="be strict",
                               rubric="{prompt} / {tag}", parser=ScoreParser(1, 5, label="final score", output="raw"))
        assert judge(torch.rand(3, 3, 8, 8), ["x", "xx", "xxxxxx"], tag=["x", "x", "x"]) == [2.0, 3.0, None]
        with pytest.raises(KeyError, match="placeholder 'tag'"):
            judge(torch.rand(1, 3, 8, 8), ["x"])
        with pytest.raises(ValueError, match="video"):
            judge(torch.rand(1, 2, 3, 8, 8), ["x"])
    with serve_handler(lambda p, b, h: (200, b'{"choices": []}')) as (url, _):
        with pytest.raises(RemoteRewardError, match="outside the chat-completions schema"):
            VLMJudgeReward(url, model="m")(torch.rand(1, 3, 8, 8), ["x"])
    with pytest.raises(ValueError, match="placeholders"):
        VLMJudgeReward("http://127.0.0.1:1", model="m", rubric="{0}")
    parser = ScoreParser()
    assert parser("Score: 7/10") == 0.7 and parser("rated 6 of 10") == 0.6 and parser("no number") is None
    assert parser("I'd say 9") == 0.9 and parser(None) is None
