"""The adapter contract (docs/adding_a_model.md, steps 4 to 6), one parametrisation over the registered families
(``registered_adapters()``; a family without a row fails ``test_every_registered_adapter_has_a_row``): the ``ode``
rollout is ``pipe(..., output_type="latent")`` bit for bit (guidance on and off, or the row's cases) and its decode
the pipeline's pixels; every registered trainer trains one iteration; the saved LoRA loads through the
pipeline's own ``load_lora_weights`` and samples exactly as the trained pipeline; a bad size is refused before any
compute. A family is one :class:`Family` row of ``FAMILIES``; what is particular to a family is in its own file.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch
from conftest import EDIT_PROMPTS, MAX_SEQ, PROMPTS
from conftest import source_image as source

import trl_flow
from trl_flow.models import get_adapter, registered_adapters
from trl_flow.rollout import sample_trajectories


@dataclass
class Family:
    """How to build, call and train one family on its tiny pipeline."""

    name: str
    make_pipe: Callable  # () -> a tiny pipeline
    pipeline: str  # its class name, as registered_adapters() lists it
    adapter_class: str  # the adapter get_adapter must pick
    height: int = 32
    width: int = 48  # non-square: a swapped height / width shows
    guidance: tuple[float, float] = (1.0, 4.5)  # guidance off, on
    options: dict = field(default_factory=dict)  # adapter options
    train_options: dict | None = None  # the trainers get get_adapter(pipe, **train_options); None: the pipeline
    pipe_kwargs: dict = field(default_factory=dict)  # what pipe() needs besides prompt, size, steps, guidance
    guidance_arg: str | None = "guidance_scale"  # pipe()'s name for guidance_scale; None: set_guidance sets it
    set_guidance: Callable | None = None  # (pipe, guidance_scale) -> None, where the pipeline holds its guidance
    takes_max_sequence_length: bool = True  # pipe() has a max_sequence_length argument
    batches_of_one: bool = False  # compare with one pipe() call per prompt (as always where sources condition)
    guides_at_one: bool = False  # the negative prompt is encoded at guidance_scale 1 too (LTX-2's audio CFG)
    config: dict = field(default_factory=dict)  # trainer config fields of the family
    sources: bool = False  # conditioned on the dataset's source_image column
    output: str = "frames"  # pipe()'s output attribute
    pack: Callable | None = None  # adapter, states -> what pipe(output_type="latent") returns
    pixels: Callable | None = None  # pipe(output_type="pt")'s output -> what decode returns (Qwen-Image 2.1: RGB)
    bad_sizes: tuple = ()  # (config overrides, message) refused before any compute
    recipe: tuple[str, str] | None = None  # (GPU recipe in trl_flow/recipes, its Hub id), trained at a tiny size
    resume: bool = False  # run the resume / evaluation test (where the family stores or chooses more than the default)
    # parity cases (id, guidance_scale, adapter options, pipe() arguments, negative embeddings expected[, transformer
    # passes per step, counted in pipe() and in the rollout]) besides `options` / `pipe_kwargs`; () = guidance off, on
    cases: tuple = ()
    tokens: Callable | None = None  # (height, width, source) -> the tokens of every transformer pass (parity)
    embeds_check: Callable | None = None  # (embeds, source) -> None: what the family's embeddings hold of a source
    source_size: tuple | None = None  # (width, height) of every dataset source; None: four sizes
    exact_sources: bool = False  # the rewards' source_image is each row's source resized to the output, exactly
    img_shapes: list | None = None  # the img_shapes argument of the rollout's first pass (Qwen-Image-Edit)
    parity_source: tuple = (40, 24)  # (width, height) of the parity test's source: another size and aspect ratio
    patch: Callable | None = None  # (monkeypatch) -> None before the pipeline runs in the parity and LoRA tests
    ema_resume: dict | None = None  # config of the resume test with EMA and KL (None: not run there)
    trainers: bool = True  # run the every-trainer test (False: a variant whose training another row checks)
    lora: bool = True  # run the LoRA round trip
    prompts: tuple | None = None  # the text prompts (None: conftest's PROMPTS, EDIT_PROMPTS where sources)
    parity_prompts: int = 2  # how many prompts the parity test samples
    latent_shape: tuple | None = None  # a sample's stored state at height x width, where the row spells it out
    train_config: dict = field(default_factory=dict)  # the every-trainer test's config overrides (e.g. max_steps=2)
    samples: bool = False  # the every-trainer test logs sample strips (log_images_steps) and checks the reward check
    lora_check: Callable | None = None  # (fresh pipeline with the saved LoRA loaded, load code) -> None

    def parity_cases(self):
        return self.cases or (("plain", self.guidance[0], {}, {}, self.guides_at_one),
                              ("guided", self.guidance[1], {}, {}, True))


def _qwen21():
    from trl_flow.testing import tiny_qwen_image21_pipeline

    return tiny_qwen_image21_pipeline()


def _hunyuan15():
    from trl_flow.testing import tiny_hunyuan_video15_pipeline

    return tiny_hunyuan_video15_pipeline()


def _set_guider(pipe, guidance_scale):
    pipe.guider = pipe.guider.new(guidance_scale=guidance_scale)


def _ltx2():
    from trl_flow.testing import tiny_ltx2_pipeline

    return tiny_ltx2_pipeline()


def _trainer_input(family):
    pipe = family.make_pipe()
    return pipe if family.train_options is None else get_adapter(pipe, **family.train_options)


def _wan_i2v(form):
    from trl_flow.testing import tiny_wan_i2v_pipeline

    return lambda: tiny_wan_i2v_pipeline(form)


_WAN_CALL = {"num_frames": 9, "negative_prompt": "ugly"}  # adapter options and pipe() arguments alike
_LTX2 = {"num_frames": 5, "frame_rate": 25.0, "negative_prompt": "ugly", "spatio_temporal_guidance_blocks": [1]}


def _tiny(name, **kwargs):
    def make():
        import trl_flow.testing

        return getattr(trl_flow.testing, f"tiny_{name}_pipeline")(**kwargs)

    return make


def _zimage_lora_targets(pipe, code):
    """diffusers' Z-Image LoRA script's targets, in the refiners and the main layers."""
    wrapped = {name.split(".lora_")[0] for name, _ in pipe.transformer.named_parameters() if ".lora_" in name}
    assert {"to_out.0" if m.endswith("to_out.0") else m.rsplit(".", 1)[1] for m in wrapped} == {
        "to_k", "to_q", "to_v", "to_out.0"}
    assert any(m.startswith("noise_refiner.") for m in wrapped) and any(m.startswith("layers.") for m in wrapped)


def _qwen_lora_targets(pipe, code):
    assert set(pipe.transformer.peft_config["default_0"].target_modules) == {"to_k", "to_q", "to_v", "to_out.0"}


def _qwen_edit_area(monkeypatch):
    """Both Qwen-Image-Edit pipelines resize the source to 32 x 32's area instead of 1024 x 1024's (what the
    adapter does with source_size="output"; 1 MP takes ~25 s to encode on CPU); every other step of pipe() is
    unchanged. test_models_qwen_image_edit checks the 1 MP rule itself."""
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit as edit
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus as plus

    rule = edit.calculate_dimensions
    monkeypatch.setattr(edit, "calculate_dimensions",
                        lambda area, ratio: rule(32 * 32 if area == 1024 * 1024 else area, ratio))
    monkeypatch.setattr(plus, "VAE_IMAGE_SIZE", 32 * 32)


def _qwen_edit_lora(pipe, code):
    _qwen_lora_targets(pipe, code)
    assert type(pipe).__name__ in code


def _qwen_edit(variant, adapter, **kwargs):
    """Qwen-Image-Edit (-2509: Plus) at 32 x 32 with 32 x 32 sources, source_size="output": 16 generated tokens,
    then the source's 16, in every pass; true CFG against " "."""
    def make():
        from trl_flow.testing import tiny_qwen_image_edit_pipeline

        return tiny_qwen_image_edit_pipeline(variant=variant)

    pipeline = {"edit": "QwenImageEditPipeline", "plus": "QwenImageEditPlusPipeline"}[variant]
    return Family(f"qwen-image-{variant}", make, pipeline, adapter,
                  width=32, guidance=(1.0, 4.5), guidance_arg="true_cfg_scale", output="images",
                  pack=lambda a, x: a.pack(x), latent_shape=(4, 8, 8), sources=True, parity_source=(32, 32),
                  source_size=(32, 32), options={"source_size": "output"}, pipe_kwargs={"negative_prompt": " "},
                  cases=(("plain", 1.0, {}, {}, False, 1), ("true-cfg", 4.0, {}, {}, True, 2)),
                  tokens=lambda H, W, src: 2 * (H // 8) * (W // 8), img_shapes=[[(1, 4, 4), (1, 4, 4)]],
                  embeds_check=lambda embeds, src: _shape_is(embeds["image_latents"], (1, 4, 8, 8)),
                  config={"source_image_size": "output"}, train_config={"max_steps": 2, "prompts_per_step": 4},
                  exact_sources=True, patch=_qwen_edit_area, lora_check=_qwen_edit_lora, **kwargs)


def _kontext_lora(pipe, code):
    cfg = pipe.transformer.peft_config["default_0"]
    assert cfg.r == 4 and cfg.lora_alpha == 8 and "ff_context.net.2" in cfg.target_modules


def _shape_is(tensor, shape):
    assert tuple(tensor.shape) == shape


def _flux2_lora(pipe, code):
    cfg = pipe.transformer.peft_config["default_0"]
    assert cfg.r == 4 and cfg.lora_alpha == 8 and "to_qkv_mlp_proj" in cfg.target_modules


_FLUX2_BAD_SIZES = (({"height": 30}, "height=30, width=32: must be multiples of 4"),
                    ({"width": 34}, "height=32, width=34: must be multiples of 4"))

# two iterations (the first ratio of each exactly 1), four prompts a step, sample strips at iteration 2
_TWO_ITERATIONS = {"max_steps": 2, "prompts_per_step": 4, "log_images_steps": 2}
_ZIMAGE_PROMPTS = ("a cat", "a red dog with a hat", "a blue car", "green sky over a very long road")  # 24 to 50 tokens

FAMILIES = [
    Family("sd3", _tiny("sd3"), "StableDiffusion3Pipeline", "SD3Adapter", latent_shape=(4, 16, 24), output="images"),
    # FLUX.1: guidance is the distilled embedding (one pass; no negative prompt), true CFG on top where asked
    Family("flux", _tiny("flux"), "FluxPipeline", "FluxAdapter", guidance=(1.0, 3.5), output="images",
           pack=lambda adapter, x: adapter.pack(x), latent_shape=(4, 16, 24), parity_prompts=3,
           cases=(("distilled", 3.5, {}, {}, False),
                  ("true-cfg", 3.5, {"true_cfg_scale": 2.5, "negative_prompt": "ugly"},
                   {"true_cfg_scale": 2.5, "negative_prompt": "ugly"}, True)),
           train_config=_TWO_ITERATIONS, samples=True),
    # Wan2.1 text-to-video (the UniPC scheduler swapped for flow-matching Euler, as training does)
    Family("wan21", _tiny("wan"), "WanPipeline", "WanAdapter", options={"num_frames": 9},
           pipe_kwargs={"num_frames": 9}, latent_shape=(4, 3, 4, 6), parity_prompts=3,  # F' = (9 - 1) / 4 + 1
           cases=(("plain", 1.0, {}, {}, False),
                  ("cfg", 4.5, {"negative_prompt": "blurry"}, {"negative_prompt": "blurry"}, True)),
           config={"num_frames": 5}, train_config=_TWO_ITERATIONS, samples=True,
           bad_sizes=(({"num_frames": 8}, "num_frames=8: Wan needs 4k \\+ 1"), ({"height": 40}, "multiples of 16"))),
    # Z-Image: guides for any scale > 0 (0: Z-Image-Turbo, one pass); prompts of different lengths, padded + masked
    Family("zimage", _tiny("zimage"), "ZImagePipeline", "ZImageAdapter", guidance=(0.0, 2.0), output="images",
           latent_shape=(4, 16, 24), prompts=_ZIMAGE_PROMPTS, parity_prompts=3,
           cases=(("turbo-no-cfg", 0.0, {}, {}, False), ("cfg", 2.0, {}, {}, True),
                  ("cfg-norm-trunc", 2.0, {"negative_prompt": "ugly", "cfg_normalization": 1.0, "cfg_truncation": 0.5},
                   {"negative_prompt": "ugly", "cfg_normalization": 1.0, "cfg_truncation": 0.5}, True)),
           config={"max_sequence_length": 48},  # the chat template alone takes 19 byte-level tokens
           train_config={"max_steps": 2, "prompts_per_step": 4}, lora_check=_zimage_lora_targets, ema_resume={},
           bad_sizes=(({"height": 34}, "height=34, width=32: must be multiples of 4"),
                      ({"width": 256}, "height=32, width=256: this Z-Image transformer's position table covers at "
                                       "most 128 x 128"),
                      ({"max_sequence_length": 250}, "max_sequence_length=250: .* at most 224 tokens"))),
    # Qwen-Image: true CFG (the negative prompt " " by default) with its norm rescaling; shift_terminal schedule
    Family("qwen-image", _tiny("qwen_image"), "QwenImagePipeline", "QwenImageAdapter", guidance=(1.0, 4.5),
           guidance_arg="true_cfg_scale", pipe_kwargs={"negative_prompt": " "}, output="images",
           pack=lambda adapter, x: adapter.pack(x), latent_shape=(4, 8, 12), parity_prompts=3,
           cases=(("plain", 1.0, {}, {}, False),
                  ("true-cfg", 4.0, {"negative_prompt": "ugly"}, {"negative_prompt": "ugly"}, True)),
           train_config={"max_steps": 2, "prompts_per_step": 4}, lora_check=_qwen_lora_targets, ema_resume={},
           bad_sizes=(({"height": 36}, "height=36, width=32: must be multiples of 8"),
                      ({"width": 65536}, "rotary embedding has 4096 positions"),
                      ({"max_sequence_length": 2048}, "max_sequence_length=2048: QwenImagePipeline takes at most "
                                                      "1024"))),
    # FLUX.2-dev: distilled guidance (the embedding, one pass); the pipeline returns the packed tokens; 40 tokens:
    # the chat template takes about 25
    Family("flux2", _tiny("flux2"), "Flux2Pipeline", "Flux2Adapter", guidance=(1.0, 4.0), output="images",
           pack=lambda adapter, x: adapter.pack(x), latent_shape=(16, 8, 12), parity_prompts=3,
           cases=(("distilled", 4.0, {}, {}, False, 1),), config={"max_sequence_length": 40},
           train_config={"max_steps": 2, "prompts_per_step": 4}, lora_check=_flux2_lora,
           bad_sizes=_FLUX2_BAD_SIZES),
    # FLUX.2 [klein] base: true CFG against the empty prompt (two passes); pipe() returns the VAE's latents
    Family("flux2-klein", _tiny("flux2_klein"), "Flux2KleinPipeline", "Flux2KleinAdapter", guidance=(1.0, 4.0),
           output="images", pack=lambda adapter, x: adapter.unpatchify(x), latent_shape=(16, 8, 12),
           parity_prompts=3, cases=(("cfg", 4.0, {}, {}, True, 2), ("plain", 1.0, {}, {}, False, 1)),
           config={"max_sequence_length": 40}, train_config={"max_steps": 2, "prompts_per_step": 4},
           lora_check=_flux2_lora, bad_sizes=_FLUX2_BAD_SIZES),
    # step-distilled FLUX.2 [klein]: guidance ignored, one pass, no negative prompt
    Family("flux2-klein-distilled", _tiny("flux2_klein", is_distilled=True), "Flux2KleinPipeline",
           "Flux2KleinAdapter", output="images", pack=lambda adapter, x: adapter.unpatchify(x),
           latent_shape=(16, 8, 12), parity_prompts=3, cases=(("guided", 4.0, {}, {}, False, 1),),
           config={"max_sequence_length": 40}, trainers=False, lora=False),
    # FLUX.1 Kontext: the source's tokens beside the generated ones in every pass; source_size="source" (the
    # pipeline's _auto_resize=False; "auto" would encode every source at ~1024 px), so one source size a batch
    Family("flux-kontext", _tiny("flux_kontext"), "FluxKontextPipeline", "FluxKontextAdapter", guidance=(1.0, 2.5),
           output="images", pack=lambda adapter, x: adapter.pack(x), latent_shape=(4, 16, 24), sources=True,
           options={"source_size": "source"}, train_options={"source_size": "source"},
           pipe_kwargs={"max_area": 32 * 48, "_auto_resize": False},
           cases=(("distilled", 2.5, {}, {}, False, 1),
                  ("true-cfg", 2.5, {"true_cfg_scale": 2.0, "negative_prompt": "ugly"},
                   {"true_cfg_scale": 2.0, "negative_prompt": "ugly"}, True, 2)),
           tokens=lambda H, W, src: (H // 4) * (W // 4) + (src.size[1] // 4) * (src.size[0] // 4),
           embeds_check=lambda embeds, src: _shape_is(embeds["image"], (1, 4, src.size[1] // 2, src.size[0] // 2)),
           source_size=(32, 32), exact_sources=True, train_config={"max_steps": 2, "prompts_per_step": 4},
           lora_check=_kontext_lora, ema_resume={"learning_rate": 3e-3}),
    _qwen_edit("edit", "QwenImageEditAdapter", ema_resume={"learning_rate": 3e-3}),
    _qwen_edit("plus", "QwenImageEditPlusAdapter", trainers=False),  # trained in the LoRA test only
    Family("wan21-i2v", _wan_i2v("2.1"), "WanImageToVideoPipeline", "WanImageToVideoAdapter", options=_WAN_CALL,
           pipe_kwargs=_WAN_CALL, config={"num_frames": 5}, sources=True,
           bad_sizes=(({"height": 40}, "multiples of 16"), ({"num_frames": 8}, "num_frames=8: Wan needs 4k \\+ 1"))),
    Family("wan22-i2v-a14b", _wan_i2v("2.2"), "WanImageToVideoPipeline", "WanImageToVideoAdapter", options=_WAN_CALL,
           pipe_kwargs=_WAN_CALL, config={"num_frames": 5}, sources=True,
           resume=True,  # two experts' LoRA files and the condition
           bad_sizes=(({"width": 24}, "multiples of 16"), ({"num_frames": 6}, "num_frames=6: Wan needs 4k \\+ 1")),
           recipe=("wan22_i2v_a14b_flow_grpo", "Wan-AI/Wan2.2-I2V-A14B-Diffusers")),
    # Qwen-Image 2.1: 64 px wide (multiples of 32); parity without the pipeline's KV cache (test_models_qwen_image21)
    Family("qwen-image-2.1", _qwen21, "QwenImage21Pipeline", "QwenImage21Adapter", width=64, guidance=(1.0, 4.0),
           guidance_arg="true_cfg_scale", takes_max_sequence_length=False,
           options={"negative_prompt": "ugly"}, pipe_kwargs={"negative_prompt": "ugly", "use_kv_cache": False},
           output="images", pack=lambda adapter, x: adapter.pack(x), pixels=lambda d: d[:, :3],
           config={"max_sequence_length": 64}, bad_sizes=(({"height": 48}, "multiples of 32"),)),
    Family("qwen-image-2.1-edit", _qwen21, "QwenImage21Pipeline", "QwenImage21Adapter", width=64, guidance=(1.0, 4.0),
           guidance_arg="true_cfg_scale", takes_max_sequence_length=False,
           options={"negative_prompt": "ugly", "conditions_on_source": True, "output_resolution": 32},
           pipe_kwargs={"negative_prompt": "ugly", "use_kv_cache": False, "output_resolution": 32},
           output="images", pack=lambda adapter, x: adapter.pack(x), pixels=lambda d: d[:, :3], sources=True,
           resume=True,  # a fresh trainer must choose editing again from the dataset
           config={"max_sequence_length": 64, "source_image_size": "output"},  # the trainer: 32 x 32 = 32 ** 2
           bad_sizes=(({"width": 40}, "multiples of 32"),),
           recipe=("qwen_image21_flow_grpo", "Qwen/Qwen-Image-2.1")),
    # HunyuanVideo-1.5: the guidance is the pipeline's guider; its VAE decodes one video at a time
    Family("hunyuan-video-1.5", _hunyuan15, "HunyuanVideo15Pipeline", "HunyuanVideo15Adapter",
           options={"num_frames": 5, "negative_prompt": "x"},
           pipe_kwargs={"num_frames": 5, "negative_prompt": "x"}, guidance_arg=None, set_guidance=_set_guider,
           takes_max_sequence_length=False, batches_of_one=True, config={"num_frames": 5},
           bad_sizes=(({"height": 40}, "multiples of 16"),
                      ({"num_frames": 6}, "num_frames=6: HunyuanVideo-1.5 needs 4k \\+ 1")),
           recipe=("hunyuan_video15_t2v_flow_grpo", "hunyuanvideo-community/HunyuanVideo-1.5-480p_t2v")),
    # LTX-2: the state is the video and audio latents together; pipe()'s guidance defaults (audio CFG, STG on block
    # 1 of the tiny transformer, modality isolation, rescale); the pipeline takes sizes in multiples of 32
    Family("ltx-2", _ltx2, "LTX2Pipeline", "LTX2Adapter", width=64, guidance=(1.0, 3.0), options=_LTX2,
           pipe_kwargs=_LTX2, guides_at_one=True, resume=True,  # one flat state of two modalities
           train_options={k: v for k, v in _LTX2.items() if k not in ("num_frames", "negative_prompt")},
           output="frames", pack=lambda adapter, x: adapter.pipe_latents(x)[0], config={"num_frames": 5},
           bad_sizes=(({"height": 48}, "multiples of 32"), ({"num_frames": 4}, "num_frames=4: LTX-2 needs 2k \\+ 1")),
           recipe=("ltx2_t2v_flow_grpo", "Lightricks/LTX-2")),
]
IDS = [f.name for f in FAMILIES]
TRAINED = [f for f in FAMILIES if f.trainers]
WITH_LORA = [f for f in FAMILIES if f.lora]
TRAINERS = sorted(set(trl_flow.registered_trainers().values()), key=lambda c: c.__name__)


# (test, row) over ~20 s on the 2 shared test cores (--durations): 54-60 s, 15-21 s
SLOW = {("recipe", "hunyuan-video-1.5"), ("resume", "ltx-2")}


def _rows(test, families):
    return [pytest.param(f, id=f.name, marks=[pytest.mark.slow] if (test, f.name) in SLOW else []) for f in families]


def test_every_registered_adapter_has_a_row():
    """Each registered pipeline class has a row naming its adapter: a new family without a row fails here."""
    registered = registered_adapters()
    rows = {f.pipeline: f.adapter_class for f in FAMILIES}
    assert set(rows) == set(registered), sorted(set(registered) ^ set(rows))
    assert all(registered[pipeline] == adapter for pipeline, adapter in rows.items())


@pytest.fixture(autouse=True)
def _quiet_scheduler_swap(monkeypatch):
    """The Wan scheduler swap warns once per process (tested in test_models_families.py)."""
    import trl_flow.models.wan as wan

    monkeypatch.setattr(wan, "_SCHEDULER_SWAP_WARNED", True)


def _prompts(family):
    return list(family.prompts or (EDIT_PROMPTS if family.sources else PROMPTS))


def _call(family, prompts, src, K, guidance_scale, height, width, **extra):
    """pipe()'s keyword arguments for these prompts (one source for all of them where the family takes one); fresh
    lists every call (Z-Image templates its prompt lists in place)."""
    call = dict(prompt=list(prompts), height=height, width=width, num_inference_steps=K)
    if family.guidance_arg is not None:
        call[family.guidance_arg] = guidance_scale
    if family.takes_max_sequence_length:
        call["max_sequence_length"] = family.config.get("max_sequence_length", MAX_SEQ)
    for k, v in {**family.pipe_kwargs, **extra}.items():
        call[k] = [v] * len(prompts) if k == "negative_prompt" else v  # (LTX-2 guides its audio even at 1)
    if family.sources:
        call["image"] = src
    return call


def _adapter(family, pipe, height, width, **extra):
    options = {**family.options, **extra}
    if family.sources:
        options["output_size"] = (height, width)
    return get_adapter(pipe, **options)


# ------------------------------------------------------------------------------------------- pipeline parity
@pytest.mark.parametrize("family,case", [(f, c) for f in FAMILIES for c in f.parity_cases()],
                         ids=[f"{f.name}-{c[0]}" for f in FAMILIES for c in f.parity_cases()])
def test_ode_rollout_reproduces_pipeline_exactly(family, case, monkeypatch):
    """From the same noise, the `ode` kernel over the adapter's schedule ends exactly where pipe() ends, and decode
    is exactly the pipeline's output_type="pt" output; a source of another size and aspect ratio than the output
    (40 x 24 px) where the family takes one."""
    _, g, case_options, case_kwargs, negative, *passes_per_step = case
    if family.patch:
        family.patch(monkeypatch)
    pipe = family.make_pipe()
    assert type(pipe).__name__ == family.pipeline
    H, W, K = family.height, family.width, 4
    adapter = _adapter(family, pipe, H, W, **case_options)
    assert type(adapter).__name__ == family.adapter_class
    max_seq = family.config.get("max_sequence_length", MAX_SEQ)
    prompts = _prompts(family)[:family.parity_prompts]
    # an image-conditioned sample is encoded alone (its conditioning must not depend on its batch): one pipe() call
    # per prompt; a text family's batch is encoded as pipe() encodes it
    batches = [[p] for p in prompts] if family.sources or family.batches_of_one else [prompts]
    if family.set_guidance:
        family.set_guidance(pipe, g)
    src = source(0, family.parity_source) if family.sources else None
    schedule = adapter.schedule(K, H, W)
    assert schedule.num_steps == K and float(schedule.sigmas[0]) == 1.0 and float(schedule.sigmas[-1]) == 0.0
    for seed, batch in enumerate(batches):
        def call():
            return _call(family, batch, src, K, g, H, W, **case_kwargs)

        passes, counted = [], bool(passes_per_step or family.tokens)

        def count(module, args, kwargs, out):  # the tokens of one transformer pass
            passes.append(((kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]).shape[1],
                           kwargs.get("img_shapes")))

        hook = pipe.transformer.register_forward_hook(count, with_kwargs=True) if counted else None
        expected = getattr(pipe(generator=torch.Generator().manual_seed(seed), output_type="latent", **call()),
                           family.output)
        if hook:
            hook.remove()
        decoded = getattr(pipe(generator=torch.Generator().manual_seed(seed), output_type="pt", **call()),
                          family.output)
        noise = adapter.initial_noise(len(batch), H, W, torch.Generator().manual_seed(seed))
        with torch.no_grad():  # as the trainer encodes
            images = {"images": [src] * len(batch)} if family.sources else {}
            embeds = adapter.encode_prompts(batch, g > 1, max_seq, **images)
        assert any(k.startswith("negative_") for k in embeds) == negative
        pipe_passes, passes[:] = list(passes), []
        hook = pipe.transformer.register_forward_hook(count, with_kwargs=True) if counted else None
        traj = sample_trajectories(adapter, adapter.trainable_module(), embeds, noise, schedule, ["ode"] * K, 0.0, g,
                                   batch_size=len(batch))
        if hook:
            hook.remove()
        if passes_per_step:
            assert passes == pipe_passes and len(passes) == K * passes_per_step[0]  # the same tokens in each
        if family.tokens:
            assert {p[0] for p in passes} == {family.tokens(H, W, src)}
        if family.img_shapes:
            assert passes[0][1] == family.img_shapes
        if family.embeds_check:
            family.embeds_check(embeds, src)
        final = traj["states"][:, -1]
        assert torch.equal(traj["states"][:, 0], noise)
        assert final.shape == (len(batch), *adapter.latent_shape(H, W))
        assert family.latent_shape is None or final.shape[1:] == family.latent_shape
        assert torch.equal(family.pack(adapter, final) if family.pack else final, expected)
        with torch.no_grad():
            ours = adapter.decode(final)
        decoded = family.pixels(decoded) if family.pixels else decoded
        assert ours.shape == (len(batch), *adapter.output_shape(H, W)) and torch.equal(ours, decoded)


# ---------------------------------------------------------------------------------------- every trainer
def _dataset(family, tmp_path):
    if not family.sources:
        return _prompts(family)
    from datasets import Dataset

    paths = []
    for i in range(len(EDIT_PROMPTS)):
        paths.append(str(tmp_path / f"src{i}.png"))
        source(i, family.source_size or (24 + 8 * i, 32)).save(paths[-1])  # sizes the adapter resizes from
    return Dataset.from_dict({"prompt": EDIT_PROMPTS, "source_image": paths})


def _config(config_class, tmp_path, family, **overrides):
    kwargs = dict(
        output_dir=str(tmp_path / "out"), max_steps=1, num_generations=2, prompts_per_step=2,
        per_device_train_batch_size=4, height=32, width=32, max_sequence_length=MAX_SEQ, num_inference_steps=3,
        eval_num_inference_steps=3, per_device_eval_batch_size=4, guidance_scale=family.guidance[1], lora_r=4,
        lora_alpha=8, learning_rate=1e-2, clip_range=5e-2, beta=0.01, disable_tqdm=True,
    )
    fields = {f.name for f in dataclasses.fields(config_class)}
    kwargs = {k: v for k, v in kwargs.items() if k in fields}  # DiffusionNFT (the run layer) has no clip_range
    kwargs.update(family.config)
    kwargs.update(overrides)
    return config_class(**kwargs)


def _has_ratio(config_class):
    """A policy-gradient trainer (a likelihood ratio, ratio_first_max_dev logged); DiffusionNFT has none."""
    from trl_flow.trainers.policy_gradient_config import PolicyGradientConfig

    return issubclass(config_class, PolicyGradientConfig)


def _brightness(images, prompts, **columns):
    return images.mean(dim=tuple(range(1, images.ndim)))


def test_every_registered_trainer_is_exported():
    assert all(getattr(trl_flow, c.__name__, None) is c for c in TRAINERS) and TRAINERS


@pytest.mark.parametrize("trainer_class", TRAINERS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("family", TRAINED, ids=[f.name for f in TRAINED])
def test_every_trainer_trains_one_iteration(tmp_path, family, trainer_class):
    """One iteration with guidance (two where the row asks): the first ratio of each is exactly 1 (rollout and
    update compute the same velocity), so is the old-vs-new kernel KL, the loss is finite, the LoRA moves; the
    rewards get the family's output shape in [0, 1] (and the sources where it takes them); where the row logs
    samples, the reward check before any compute gets two samples of that shape and a strip (one file per video) is
    written."""
    seen, ranges = [], []
    dataset = _dataset(family, tmp_path)
    if family.exact_sources:
        from trl_flow.editing import load_source, source_tensor

        rows = {p: source_tensor([load_source(s, 0, "source_image")], 32, 32)[0]
                for p, s in zip(dataset["prompt"], dataset["source_image"])}

    def reward(images, prompts, **columns):
        if family.exact_sources:  # each row's own source, decoded and resized to the output, float32
            src = columns["source_image"]
            assert src.dtype == torch.float32 and src.shape == images.shape
            assert all(torch.equal(src[i], rows[p]) for i, p in enumerate(prompts))
        seen.append((tuple(images.shape), "source_image" in columns))
        ranges.append((float(images.min()), float(images.max())))
        return _brightness(images, prompts)

    config = _config(trainer_class.config_class, tmp_path, family, **family.train_config)
    trainer = trainer_class(config, _trainer_input(family), [reward], train_dataset=dataset)
    assert type(trainer.adapter).__name__ == family.adapter_class
    shape = trainer.adapter.output_shape(32, 32)
    if family.samples:
        assert seen == [((2, *shape), family.sources)]  # the reward check before any compute
    before = [p.detach().clone() for p in trainer.trainable_params]
    state = trainer.train()
    assert {(s[1:], src) for s, src in seen} == {(shape, family.sources)}
    assert ranges and all(0.0 <= lo <= hi <= 1.0 for lo, hi in ranges)
    assert sum(s[0] for s, _ in seen) >= 2 + config.max_steps * config.prompts_per_step * config.num_generations
    assert len(state.log_history) == config.max_steps
    for entry in state.log_history:
        if _has_ratio(trainer_class.config_class):  # DiffusionNFT has no ratio
            assert entry["ratio_first_max_dev"] == 0.0
        assert entry.get("kl_old_first_max", 0.0) == 0.0  # old-vs-new kernel KL before the first update
        assert torch.isfinite(torch.tensor(entry["loss"])) and entry["nonfinite_skipped"] == 0
    assert any(not torch.equal(b, p) for b, p in zip(before, trainer.trainable_params))
    if family.samples:
        samples = tmp_path / "out" / "samples"
        assert (samples / f"train_step_{config.max_steps}.png").exists()
        videos = list(samples.glob(f"train_step_{config.max_steps}_*.*"))
        if len(shape) == 4:  # one GIF/MP4 per video
            assert len(videos) == config.prompts_per_step * config.num_generations


@pytest.mark.parametrize("family", WITH_LORA, ids=[f.name for f in WITH_LORA])
def test_lora_round_trips_through_the_pipelines_loader(tmp_path, family, monkeypatch):
    """save_model -> a fresh pipeline's load_lora_weights (the model card's snippet) -> exactly the trained
    pipeline's samples, which differ from the base pipeline's."""
    from trl_flow import FlowGRPOConfig, FlowGRPOTrainer

    if family.patch:
        family.patch(monkeypatch)
    config = _config(FlowGRPOConfig, tmp_path, family, beta=0.0)
    trainer = FlowGRPOTrainer(config, _trainer_input(family), [_brightness], train_dataset=_dataset(family, tmp_path))
    trainer.train()
    out = trainer.save_model(str(tmp_path / "final"))
    fresh = family.make_pipe()
    _adapter(family, fresh, 32, 32)  # the same scheduler swap (Wan) the trained pipeline got
    frames = {k: v for k, v in family.config.items() if k == "num_frames"}

    def run(pipe):
        call = _call(family, _prompts(family)[:1], source(1), 3, family.guidance[1], 32, 32, **frames)
        with torch.no_grad():
            return getattr(pipe(generator=torch.Generator().manual_seed(0), output_type="latent", **call),
                           family.output)

    if family.set_guidance:
        family.set_guidance(fresh, family.guidance[1])
        family.set_guidance(trainer.pipe, family.guidance[1])
    base = run(fresh)
    code = trainer.adapter.lora_load_code(out)
    exec(code, {"pipe": fresh})  # the model card's snippet: the pipeline's loader
    loaded, trained = run(fresh), run(trainer.pipe)
    assert torch.equal(loaded, trained)
    assert (loaded - base).abs().max() > 1e-4  # the LoRA is not a no-op
    if family.lora_check:
        family.lora_check(fresh, code)


@pytest.mark.parametrize("family", _rows("resume", [f for f in FAMILIES if f.resume]))
def test_resume_repeats_an_uninterrupted_run_and_evaluates_with_the_sources(tmp_path, family):
    """3 iterations straight == 1, a checkpoint, then a fresh trainer and pipeline resumed for 2 more: every trained
    LoRA weight and the logged values bit for bit; evaluation (before the first iteration, every 2 and after the
    last) samples as generate() does, conditioning each eval prompt on its own source where the family takes one."""
    import numpy as np

    from trl_flow import FlowGRPOConfig, FlowGRPOTrainer

    dataset = _dataset(family, tmp_path)

    def run(name, max_steps, resume=None, **kw):
        config = _config(FlowGRPOConfig, tmp_path, family, output_dir=str(tmp_path / name), max_steps=max_steps,
                         prompts_per_step=2, learning_rate=3e-3, **kw)  # (no EMA: evaluation samples the policy)
        trainer = FlowGRPOTrainer(config, _trainer_input(family), [_brightness], train_dataset=dataset,
                                  eval_dataset=dataset.select([0, 1]) if family.sources else dataset[:2])
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    def lora(trainer):
        return {n: p.detach().clone() for n, p in trainer.adapter.trainable_module().named_parameters()
                if "lora_" in n}

    straight = run("a", 3, eval_steps=2, per_device_eval_batch_size=2)
    run("b", 1, save_steps=1)
    torch.manual_seed(1234)
    resumed = run("b", 3, resume=str(tmp_path / "b" / "checkpoint-1"), save_steps=1)
    assert resumed.state.global_step == 3
    wa, wb = lora(straight), lora(resumed)
    assert wa.keys() == wb.keys() and wa and all(torch.equal(wa[k], wb[k]) for k in wa)
    keys = ("loss", "reward", "ratio_max")
    train_logs = [[e[k] for k in keys] for e in straight.state.log_history if "loss" in e]
    assert [[e[k] for k in keys] for e in resumed.state.log_history[1:] if "loss" in e] == train_logs[1:]
    assert np.isfinite([e["eval/reward"] for e in straight.state.log_history if "eval/reward" in e]).all()
    if not family.sources:
        images, _ = straight.generate(dataset[:2], seed=straight.config.seed + 10_007)
        assert torch.equal(images, straight.last_eval_images)
        return
    rows = dataset.select([0, 1])[:]
    images, _ = straight.generate(rows["prompt"], seed=straight.config.seed + 10_007,
                                  columns={"source_image": rows["source_image"]})
    assert torch.equal(images, straight.last_eval_images)
    swapped, _ = straight.generate(rows["prompt"], seed=straight.config.seed + 10_007,
                                   columns={"source_image": rows["source_image"][::-1]})
    assert not torch.allclose(images, swapped)


# ------------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("family,overrides,match",
                         [(f, o, m) for f in FAMILIES for o, m in f.bad_sizes],
                         ids=[f"{f.name}-{'-'.join(o)}" for f in FAMILIES for o, _ in f.bad_sizes])
def test_bad_size_is_refused_before_any_compute(tmp_path, family, overrides, match):
    """A ValueError naming the size, before any reward call or forward pass of any component of the pipeline."""
    from trl_flow import FlowGRPOConfig, FlowGRPOTrainer

    calls = []
    model = _trainer_input(family)
    pipe = getattr(model, "pipe", model)
    hooks = [module.register_forward_hook(lambda *a, name=name: calls.append(name))
             for name, module in pipe.components.items() if isinstance(module, torch.nn.Module)]
    assert any(name.startswith("text_encoder") for name in pipe.components) and hooks
    config = _config(FlowGRPOConfig, tmp_path, family, **overrides)
    with pytest.raises(ValueError, match=match):
        FlowGRPOTrainer(config, model, [lambda im, p, **c: calls.append("reward") or [0.0] * len(p)],
                        train_dataset=_dataset(family, tmp_path))
    for hook in hooks:
        hook.remove()
    assert calls == []  # no reward, encoder, transformer or VAE call


@pytest.mark.parametrize("family", _rows("ema_resume", [f for f in FAMILIES if f.ema_resume is not None]))
def test_resume_with_ema_and_kl_repeats_an_uninterrupted_run(tmp_path, family):
    """3 iterations straight == 1, a checkpoint, then a fresh trainer and pipeline resumed for 2 more from another
    global RNG state (KL to the reference and EMA on; the sources re-read from the dataset): every trained LoRA
    weight, the EMA and the logged step, loss, reward, KL and ratio bit for bit."""
    from trl_flow import FlowGRPOConfig, FlowGRPOTrainer

    dataset = _dataset(family, tmp_path)

    def run(name, max_steps, resume=None, **kw):
        config = _config(FlowGRPOConfig, tmp_path, family, output_dir=str(tmp_path / name), max_steps=max_steps,
                         beta=0.01, ema_decay=0.9, **family.ema_resume, **kw)
        trainer = FlowGRPOTrainer(config, _trainer_input(family), [_brightness], train_dataset=dataset)
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    def lora(trainer):
        return {n: p.detach().clone() for n, p in trainer.adapter.trainable_module().named_parameters()
                if "lora_" in n}

    straight = run("a", 3)
    run("b", 1, save_steps=1)
    torch.manual_seed(1234)  # everything must come from the checkpoint
    resumed = run("b", 3, resume=str(tmp_path / "b" / "checkpoint-1"), save_steps=1)
    assert resumed.state.global_step == 3
    wa, wb = lora(straight), lora(resumed)
    assert wa.keys() == wb.keys() and wa and all(torch.equal(wa[k], wb[k]) for k in wa)
    ema_a, ema_b = straight.ema.shadow_params, resumed.ema.shadow_params
    assert ema_a and len(ema_a) == len(ema_b) and all(torch.equal(a, b) for a, b in zip(ema_a, ema_b))
    keys = ("step", "loss", "reward", "kl", "ratio_max")
    assert len(straight.state.log_history) == 3
    assert [[e[k] for k in keys] for e in resumed.state.log_history[1:]] == [
        [e[k] for k in keys] for e in straight.state.log_history[1:]]


# ---------------------------------------------------------------------------------------------------- recipes
@pytest.mark.parametrize("family", _rows("recipe", [f for f in FAMILIES if f.recipe]))
def test_recipe_settings_train_on_the_tiny_pipeline(tmp_path, family):
    """The recipe names the real Hub id of the family's pipeline class, and its settings (LoRA targets, guidance,
    SDE window, experts) train one iteration on the tiny pipeline at a tiny size and batch; every trained component
    gets every LoRA target."""
    import dataclasses

    from trl_flow import FlowGRPOTrainer, cli

    name, hub_id = family.recipe
    script, config, _ = cli.parse_args("grpo", ["--config", name])
    assert script.model_name_or_path == hub_id
    tiny = dict(output_dir=str(tmp_path / "out"), height=32, width=32, max_sequence_length=MAX_SEQ, num_generations=2,
                prompts_per_step=2, per_device_train_batch_size=2, gradient_accumulation_steps=1, max_steps=1,
                bf16=False, gradient_checkpointing=False, disable_tqdm=True, eval_num_inference_steps=4,
                per_device_eval_batch_size=2)
    tiny.update({k: v for k, v in family.config.items() if k in ("num_frames", "max_sequence_length")})
    config = dataclasses.replace(config, **tiny)
    trainer = FlowGRPOTrainer(config, _trainer_input(family), [_brightness], train_dataset=_dataset(family, tmp_path))
    assert type(trainer.adapter).__name__ == family.adapter_class
    state = trainer.train()
    assert state.global_step == 1 and state.log_history[0]["ratio_first_max_dev"] == 0.0
    targets = config.lora_target_modules or list(trainer.adapter.default_lora_target_modules)
    for name in trainer.adapter.trained_components():
        params = getattr(trainer.pipe, name).named_parameters()
        adapted = {n.rsplit(".lora_", 1)[0] for n, _ in params if ".lora_" in n}
        assert all(any(a.endswith(t) for a in adapted) for t in targets), (name, targets)

