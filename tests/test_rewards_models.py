"""The shipped reward models on tiny random models of the real classes, saved to disk and loaded through the
real loading code; each score is checked against an independent computation."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
import torch

from trl_flow import rewards
from trl_flow.rewards import base as reward_base
from trl_flow.rewards.ocr import edit_distance, ocr_similarity, quoted_text
from trl_flow.testing import _byte_level_clip_tokenizer

PROMPTS = ["a red cube", "two cats", 'a sign that says "OPEN"', "green sky", "a dog"]


def _images(n=5, seed=0, size=40):
    return torch.rand(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(autouse=True)
def _fresh_cache():
    rewards.clear_model_cache()
    yield
    rewards.clear_model_cache()


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    """A tiny random ``CLIPModel`` + ``CLIPProcessor`` saved with ``save_pretrained``."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    tok = _byte_level_clip_tokenizer(32)
    text = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=37, num_hidden_layers=1, num_attention_heads=2,
                max_position_embeddings=32, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id)
    vision = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                  patch_size=8)
    torch.manual_seed(0)
    model = CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=16))
    processor = CLIPProcessor(image_processor=CLIPImageProcessor(size={"shortest_edge": 32},
                                                                  crop_size={"height": 32, "width": 32}),
                                                                  tokenizer=tok)
    d = tmp_path_factory.mktemp("clip")
    model.save_pretrained(d)
    processor.save_pretrained(d)
    return str(d)


def _reference_clip(clip_dir, images, prompts):
    """Independent path: CLIPModel.forward (its own logits_per_image and normalised image_embeds)."""
    from transformers import CLIPModel, CLIPProcessor

    model = CLIPModel.from_pretrained(clip_dir).eval()
    proc = CLIPProcessor.from_pretrained(clip_dir)
    u8 = (images.clamp(0, 1) * 255).round().to(torch.uint8)
    inputs = proc(text=prompts, images=list(u8), padding=True, truncation=True, return_tensors="pt")
    with torch.no_grad():
        return model(**inputs), model.logit_scale.exp()


def test_pickscore_and_clip_score_arithmetic(clip_dir):
    images = _images()
    ref, scale = _reference_clip(clip_dir, images, PROMPTS)
    pick = rewards.pickscore(model_name_or_path=clip_dir, processor_name_or_path=clip_dir)
    clip = rewards.clip_score(model_name_or_path=clip_dir)
    # PickScore = logit_scale * cos; CLIP score = cos
    assert torch.allclose(torch.tensor(pick(images, PROMPTS)), ref.logits_per_image.diag(), atol=1e-5)
    assert torch.allclose(torch.tensor(clip(images, PROMPTS)), ref.logits_per_image.diag() / scale, atol=1e-6)
    assert pick.__name__ == "pickscore" and clip.__name__ == "clip_score"
    assert rewards.reward_name(pick) == "pickscore"
    # the prompt matters: a shuffled prompt list changes the scores
    assert not np.allclose(pick(images, PROMPTS[::-1]), pick(images, PROMPTS))


def test_aesthetic_arithmetic(clip_dir, tmp_path):
    torch.manual_seed(1)
    mlp = rewards.clip.AestheticMLP(16)
    torch.save(mlp.state_dict(), tmp_path / "aesthetic-model.pth")
    images = _images()
    ref, _ = _reference_clip(clip_dir, images, PROMPTS)
    sd = torch.load(tmp_path / "aesthetic-model.pth", weights_only=True)
    x = ref.image_embeds  # normalised CLIP image embeddings
    for i in (0, 2, 4, 6, 7):  # the linear layers; dropout is the identity in eval
        x = x @ sd[f"layers.{i}.weight"].T + sd[f"layers.{i}.bias"]
    reward = rewards.aesthetic(model_name_or_path=clip_dir, mlp_name_or_path=str(tmp_path))
    got = torch.tensor(reward(images, ["ignored"] * 5))
    assert torch.allclose(got, x.squeeze(-1), atol=1e-5)


def test_loaded_once_batched_video_and_dtype(clip_dir, monkeypatch):
    from transformers import CLIPModel

    calls = []
    orig = CLIPModel.from_pretrained.__func__

    def counting(cls, *a, **k):
        calls.append(a[0])
        return orig(cls, *a, **k)

    monkeypatch.setattr(CLIPModel, "from_pretrained", classmethod(counting))
    images = _images()
    a = rewards.clip_score(model_name_or_path=clip_dir, batch_size=2)
    b = rewards.clip_score(model_name_or_path=clip_dir, batch_size=32)
    sa, sb = a(images, PROMPTS), b(images, PROMPTS)
    assert len(calls) == 1  # two rewards, one checkpoint: loaded once
    assert a.load() is b.load()
    assert np.allclose(sa, sb, atol=1e-6)  # batches of 2 == one batch of 5
    # video (B, F, 3, H, W): the mean of the per-frame scores
    video = torch.stack([images[:3], images[2:]], dim=1)  # (3, 2, 3, H, W)
    per_frame = [a(video[:, f], PROMPTS[:3]) for f in range(2)]
    assert np.allclose(a(video, PROMPTS[:3]), np.mean(per_frame, axis=0), atol=1e-6)
    # the trainer's dtype: prepare() fills what the constructor left unset
    c = rewards.clip_score(model_name_or_path=clip_dir)
    c.prepare("cpu", torch.bfloat16)
    model, _ = c.load()
    assert next(model.parameters()).dtype == torch.bfloat16 and not next(model.parameters()).requires_grad
    assert np.allclose(c(images, PROMPTS), sa, atol=0.05)
    fixed = rewards.clip_score(model_name_or_path=clip_dir, dtype="float32")
    fixed.prepare("cpu", torch.bfloat16)
    assert fixed.dtype == torch.float32


def test_bad_input_and_misuse(clip_dir):
    reward = rewards.pickscore(model_name_or_path=clip_dir, processor_name_or_path=clip_dir)
    with pytest.raises(ValueError, match="pickscore.*B, 3, H, W"):
        reward(torch.rand(2, 4, 8, 8), ["a", "b"])
    with pytest.raises(ValueError, match="pickscore: got 2 images for 3 prompts"):
        reward(torch.rand(2, 3, 8, 8), ["a", "b", "c"])
    with pytest.raises(TypeError, match=r"rewards=\[pickscore\(\)\]"):
        rewards.pickscore(torch.rand(2, 3, 8, 8), ["a", "b"])
    with pytest.raises(ValueError, match="batch_size"):
        rewards.clip_score(batch_size=0)
    with pytest.raises(ValueError, match="dtype"):
        rewards.clip_score(dtype="float8")


# ------------------------------------------------------------------------------------------------ HPSv2, ImageReward
class _StandInCLIP(torch.nn.Module):
    """Stands in for an OpenCLIP model: encode_image / encode_text of the same interface."""

    def __init__(self):
        super().__init__()
        self.visual = torch.nn.Linear(3 * 8 * 8, 6)
        self.text = torch.nn.Embedding(256, 6)

    def encode_image(self, x):
        return self.visual(x.flatten(1))

    def encode_text(self, tokens):
        return self.text(tokens).mean(1)


def _standin_preprocess(pil):
    arr = np.asarray(pil.resize((8, 8)), dtype=np.float32) / 255.0
    return torch.from_numpy(arr).permute(2, 0, 1)


def _standin_tokenizer(prompts):
    return torch.tensor([[ord(c) % 256 for c in p.ljust(12)[:12]] for p in prompts])


@pytest.fixture
def fake_open_clip(monkeypatch):
    mod = types.ModuleType("open_clip")
    mod.created = []

    def create_model_and_transforms(name, pretrained=None, **kw):
        mod.created.append((name, pretrained))
        torch.manual_seed(123)  # different from the checkpoint: load_state_dict must take effect
        return _StandInCLIP(), None, _standin_preprocess

    mod.create_model_and_transforms = create_model_and_transforms
    mod.get_tokenizer = lambda name: _standin_tokenizer
    monkeypatch.setitem(sys.modules, "open_clip", mod)
    return mod


def test_hpsv2_with_a_stand_in_open_clip(fake_open_clip, tmp_path):
    """Only the glue and the arithmetic (cosine of the normalised embeddings), with a stand-in for OpenCLIP."""
    torch.manual_seed(7)
    ckpt = _StandInCLIP()
    torch.save({"state_dict": ckpt.state_dict()}, tmp_path / "HPS_v2.1_compressed.pt")
    images = _images(3)
    prompts = PROMPTS[:3]
    reward = rewards.hpsv2(checkpoint_name_or_path=str(tmp_path))
    got = torch.tensor(reward(images, prompts))
    pix = torch.stack([_standin_preprocess(p) for p in reward_base.to_pil(images)])
    with torch.no_grad():
        img = torch.nn.functional.normalize(ckpt.encode_image(pix), dim=-1)
        txt = torch.nn.functional.normalize(ckpt.encode_text(_standin_tokenizer(prompts)), dim=-1)
    assert torch.allclose(got, (img * txt).sum(-1), atol=1e-6)
    assert fake_open_clip.created == [("ViT-H-14", None)]
    with pytest.raises(ValueError, match="version"):
        rewards.hpsv2(version="v3")


def test_image_reward_with_a_stand_in_package(monkeypatch):
    """Only the glue (one score call per distinct prompt of a batch, scalar answers), with a stand-in package."""
    calls = []

    class StandIn(torch.nn.Module):
        def score(self, prompt, images):
            calls.append((prompt, len(images)))
            s = [float(np.asarray(im).mean()) + len(prompt) for im in images]
            return s[0] if len(s) == 1 else s

    mod = types.ModuleType("ImageReward")
    mod.load = lambda name, device="cpu", **kw: StandIn()
    monkeypatch.setitem(sys.modules, "ImageReward", mod)
    images = _images(4)
    prompts = ["a", "bb", "a", "ccc"]
    got = rewards.image_reward()(images, prompts)
    means = [float(np.asarray(p).mean()) for p in reward_base.to_pil(images)]
    assert np.allclose(got, [m + len(p) for m, p in zip(means, prompts)])
    assert sorted(calls) == [("a", 2), ("bb", 1), ("ccc", 1)]


def test_missing_extra_is_named_when_the_reward_is_built(monkeypatch):
    monkeypatch.setitem(sys.modules, "open_clip", None)
    monkeypatch.setitem(sys.modules, "ImageReward", None)
    with pytest.raises(ImportError, match=r"pip install 'trl_flow\[hpsv2\]'"):
        rewards.hpsv2()
    with pytest.raises(ImportError, match=r"pip install 'trl_flow\[image-reward\]'"):
        rewards.get_reward("image_reward")


# ------------------------------------------------------------------------------------------------------- OCR
@pytest.fixture(scope="module")
def trocr_dir(tmp_path_factory):
    """A tiny random TrOCR (ViT encoder + TrOCR decoder) and TrOCRProcessor saved with save_pretrained."""
    from transformers import (TrOCRConfig, TrOCRProcessor, ViTConfig, ViTImageProcessor, VisionEncoderDecoderConfig,
                              VisionEncoderDecoderModel)

    tok = _byte_level_clip_tokenizer(32)
    enc = ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=37, image_size=32,
                    patch_size=8)
    dec = TrOCRConfig(vocab_size=len(tok), d_model=32, decoder_layers=1, decoder_attention_heads=2,
                      decoder_ffn_dim=37, max_position_embeddings=64, pad_token_id=tok.pad_token_id,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      decoder_start_token_id=tok.bos_token_id)
    cfg = VisionEncoderDecoderConfig.from_encoder_decoder_configs(enc, dec)
    cfg.decoder_start_token_id, cfg.pad_token_id = tok.bos_token_id, tok.pad_token_id
    cfg.eos_token_id = tok.eos_token_id
    torch.manual_seed(0)
    model = VisionEncoderDecoderModel(cfg)
    model.generation_config.suppress_tokens = [tok.bos_token_id]  # so the random model reads some characters
    d = tmp_path_factory.mktemp("trocr")
    model.save_pretrained(d)
    processor = TrOCRProcessor(image_processor=ViTImageProcessor(size={"height": 32, "width": 32}), tokenizer=tok)
    processor.save_pretrained(d)
    return str(d)


def test_edit_distance_and_similarity_by_hand():
    assert edit_distance("kitten", "sitting") == 3
    assert edit_distance("", "abc") == 3 and edit_distance("abc", "abc") == 0
    assert edit_distance("flaw", "lawn") == 2
    assert ocr_similarity("Hello World", "helloworld") == 1.0  # case and spaces ignored
    assert ocr_similarity("hallo", "hello") == pytest.approx(0.8)  # 1 - 1/5
    assert ocr_similarity("", "open") == 0.0
    assert ocr_similarity("a very long unrelated text", "open") == 0.0  # distance clipped at the target length
    assert ocr_similarity("anything", "  ") is None
    assert quoted_text('a sign saying "Hello" and \u201cworld\u201d') == "Hello world"
    assert quoted_text("no quotes") is None


def test_ocr_reads_with_the_real_model_and_scores_the_quoted_text(trocr_dir, monkeypatch):
    from transformers import TrOCRProcessor, VisionEncoderDecoderModel

    reward = rewards.ocr(model_name_or_path=trocr_dir, max_new_tokens=6)
    images = _images(3)
    # recognition through the reward == the model's own generate + decode (independent path)
    model = VisionEncoderDecoderModel.from_pretrained(trocr_dir).eval()
    proc = TrOCRProcessor.from_pretrained(trocr_dir)
    u8 = (images * 255).round().to(torch.uint8)
    with torch.no_grad():
        ids = model.generate(proc(images=list(u8), return_tensors="pt").pixel_values, max_new_tokens=6)
    expected_text = proc.batch_decode(ids, skip_special_tokens=True)
    texts = reward.recognise(reward.load(), images)
    assert texts == expected_text and any(texts)
    prompts = ['a sign "OPEN"', "no text here", f'the word "{texts[2]}" on a wall']
    got = reward(images, prompts)
    assert got[1] is None and got[2] == 1.0  # the target equal to what the model reads scores 1
    assert got[0] == pytest.approx(ocr_similarity(texts[0], "OPEN"))
    # the arithmetic on known readings
    monkeypatch.setattr(type(reward), "recognise", lambda self, comp, ims: ["OPEN", "xyz", "0PEN"][: len(ims)])
    assert reward(images, ['"open"', '"cat"', '"OPEN"']) == [1.0, 0.0, pytest.approx(0.75)]
    by_column = rewards.ocr(model_name_or_path=trocr_dir, text_column="text")
    assert by_column(images, ["x", "y", "z"], text=["open", None, "OPEN"]) == [1.0, None, pytest.approx(0.75)]
    with pytest.raises(KeyError, match="text_column='text'"):
        by_column(images, ["x", "y", "z"])


# ------------------------------------------------------------------------------------------------- registry
def test_registry_by_name_and_dotted_path(clip_dir):
    assert {"pickscore", "clip_score", "aesthetic", "hpsv2", "image_reward", "ocr", "jpeg_compressibility",
            "shapes_strict", "remote", "vlm_judge"} <= set(rewards.available_rewards())
    r = rewards.get_reward("pickscore", model_name_or_path=clip_dir, processor_name_or_path=clip_dir)
    assert isinstance(r, rewards.PickScoreReward) and r.model_name_or_path == clip_dir
    assert rewards.get_reward("jpeg_compressibility") is rewards.jpeg_compressibility
    from trl_flow.tasks.shapes import shapes_strict_reward

    assert rewards.get_reward("shapes_strict") is shapes_strict_reward
    assert rewards.get_reward("trl_flow.tasks.shapes:shapes_strict_reward") is shapes_strict_reward
    built = rewards.get_reward("trl_flow.rewards:CLIPScoreReward", model_name_or_path=clip_dir, batch_size=3)
    assert isinstance(built, rewards.CLIPScoreReward) and built.batch_size == 3
    with pytest.raises(ValueError, match="unknown name.*pickscore"):
        rewards.get_reward("pick_score")
    with pytest.raises(ValueError, match="cannot import module 'no_such_module'"):
        rewards.get_reward("no_such_module:f")
    with pytest.raises(ValueError, match="has no attribute 'nope'"):
        rewards.get_reward("trl_flow.rewards:nope")
    with pytest.raises(TypeError, match="takes no keyword arguments"):
        rewards.get_reward("trl_flow.tasks.shapes:shapes_strict_reward", x=1)
    with pytest.raises(TypeError, match="takes no keyword arguments"):
        rewards.get_reward("jpeg_compressibility", quality=90)

    @rewards.register_reward("my_brightness")
    def _factory(scale=1.0):
        return lambda images, prompts, **c: (images.mean(dim=(1, 2, 3)) * scale).tolist()

    assert rewards.get_reward("my_brightness", scale=2.0)(torch.ones(2, 3, 4, 4), ["a", "b"]) == [2.0, 2.0]


@pytest.fixture
def fresh_accelerate_state():
    """accelerate keeps one AcceleratorState per process and refuses a second mixed-precision setting."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def test_trainer_puts_reward_models_on_its_device_and_dtype(clip_dir, make_trainer, fresh_accelerate_state):
    reward = rewards.clip_score(model_name_or_path=clip_dir)
    trainer = make_trainer(rewards=[reward], bf16=True, max_steps=1)
    assert trainer.reward_names == ["clip_score"]
    assert reward.device == trainer.device and reward.dtype == torch.bfloat16
    model, _ = reward.load()
    assert next(model.parameters()).dtype == torch.bfloat16  # loaded by the constructor's reward check
