"""What is particular to Wan image-to-video (WanImageToVideoPipeline: Wan2.1-I2V and Wan2.2-I2V-A14B); the contract
itself (parity, every trainer, LoRA round trip, bad sizes, recipe) is tests/test_models_conformance.py."""

from __future__ import annotations

import pytest
import torch
from conftest import EDIT_PROMPTS as PROMPTS
from conftest import MAX_SEQ
from conftest import source_image as source

from trl_flow.models import cat_embeds, get_adapter, index_embeds
from trl_flow.models.wan_i2v import WanImageToVideoAdapter
from trl_flow.testing import tiny_wan_i2v_pipeline

H = W = 32


@pytest.fixture(autouse=True)
def _quiet_scheduler_swap(monkeypatch):
    import trl_flow.models.wan as wan

    monkeypatch.setattr(wan, "_SCHEDULER_SWAP_WARNED", True)


@pytest.mark.parametrize("form", ["2.1", "2.2"])
def test_source_conditions_and_embeds_do_not_depend_on_the_batch(form):
    """The source is conditioning (another source, another velocity); a sample's conditioning encoded alone equals
    its row of a batch bit for bit, and indexes / concatenates like the text's; Wan2.1 stores the CLIP embedding,
    Wan2.2 has none; a source shared by two samples is VAE-encoded once."""
    adapter = get_adapter(tiny_wan_i2v_pipeline(form), num_frames=5, output_size=(H, W))
    assert type(adapter) is WanImageToVideoAdapter and adapter.conditioning == "text_and_image"
    assert adapter.pipeline_tag == "image-to-video" and adapter.two_experts == (form == "2.2")
    srcs = [source(0), source(1, (48, 16)), source(0)]
    calls, encode = [], adapter.pipe.vae.encode
    adapter.pipe.vae.encode = lambda *a, **kw: calls.append(1) or encode(*a, **kw)
    with torch.no_grad():
        both = adapter.encode_prompts(PROMPTS[:2] + PROMPTS[:1], True, MAX_SEQ, images=[srcs[0], srcs[1], srcs[0]])
        assert len(calls) == 2
        one = adapter.encode_prompts(PROMPTS[1:2], True, MAX_SEQ, images=srcs[1:2])
    assert set(both) == {"prompt_embeds", "negative_prompt_embeds", "condition"} | (
        {"image_embeds"} if form == "2.1" else set())
    assert both["condition"].shape == (3, 4 + 4, 2, H // 8, W // 8)
    assert bool((both["condition"][:, :4, 0] == 1).all()) and bool((both["condition"][:, :4, 1:] == 0).all())
    for k in both:
        assert torch.equal(index_embeds(both, [1])[k], one[k]), k
        assert torch.equal(cat_embeds([index_embeds(both, [0]), one])[k], both[k][:2]), k
    x = adapter.initial_noise(1, H, W, torch.Generator().manual_seed(0)).repeat(2, 1, 1, 1, 1)
    t = adapter.schedule(3, H, W).timesteps[0]
    two = index_embeds(both, [0, 1])
    swapped = {k: v.flip(0) if k in ("condition", "image_embeds") else v for k, v in two.items()}
    with torch.no_grad():
        v, v_swapped = (adapter.velocity(adapter.trainable_module(), x, t, e, 4.5) for e in (two, swapped))
    assert not torch.allclose(v, v_swapped)


def test_refusals_name_the_fix(monkeypatch):
    import diffusers.pipelines.wan.pipeline_wan_i2v as i2v

    adapter = WanImageToVideoAdapter(tiny_wan_i2v_pipeline(), num_frames=5)
    with pytest.raises(ValueError, match="needs images= with one source image per prompt"):
        adapter.encode_prompts(PROMPTS[:2], False, MAX_SEQ)
    with pytest.raises(ValueError, match="pass output_size=\\(height, width\\) or let a trainer configure"):
        adapter.encode_prompts(PROMPTS[:1], False, MAX_SEQ, images=[source(0)])
    pipe = tiny_wan_i2v_pipeline()
    pipe.register_to_config(expand_timesteps=True)
    with pytest.raises(ValueError, match="expand_timesteps=True \\(Wan2.2-TI2V-5B's image-to-video\\) is not"):
        get_adapter(pipe)
    pipe = tiny_wan_i2v_pipeline()
    pipe.image_encoder = None
    with pytest.raises(ValueError, match="no image_encoder / image_processor"):
        get_adapter(pipe)
    monkeypatch.delattr(i2v, "ftfy", raising=False)
    with pytest.raises(ImportError, match="pip install ftfy"):
        get_adapter(tiny_wan_i2v_pipeline())


def test_a_dataset_without_sources_is_refused_before_any_compute(tmp_path):
    from trl_flow import FlowGRPOConfig, FlowGRPOTrainer

    calls = []
    config = FlowGRPOConfig(output_dir=str(tmp_path), height=H, width=W, num_frames=5, max_sequence_length=MAX_SEQ,
                            num_inference_steps=2, num_generations=2, prompts_per_step=1,
                            per_device_train_batch_size=2, disable_tqdm=True)
    with pytest.raises(ValueError, match="train_dataset: no `source_image` column"):
        FlowGRPOTrainer(config, tiny_wan_i2v_pipeline(), [lambda im, p, **c: calls.append(1) or [0.0] * len(p)],
                        train_dataset=PROMPTS)
    assert calls == []
