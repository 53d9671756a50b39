"""The public adapter API: a family added from outside the package trains with an exported trainer,
through ``register_adapter`` or a ``trl_flow.adapters`` entry point; bad registrations fail clearly; a broken
plug-in warns without breaking the built-in families; every code block of docs/adding_a_model.md runs.

The registry is a module global: every test here runs on a copy of it (``_isolated_registry``).
"""

from __future__ import annotations

import os
import re
import warnings
from importlib.metadata import EntryPoint

import pytest
import torch
from conftest import HEIGHT, MAX_SEQ, PROMPTS, WIDTH, brightness, tiny_config
from diffusers import DiffusionPipeline, StableDiffusion3Pipeline

import trl_flow.models as models
from trl_flow import FlowGRPOTrainer
from trl_flow.models import FlowAdapter, SD3Adapter, Schedule, get_adapter, register_adapter, registered_adapters
from trl_flow.testing import tiny_sd3_pipeline

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GUIDE = os.path.join(ROOT, "docs", "adding_a_model.md")


@pytest.fixture(autouse=True)
def _isolated_registry(monkeypatch):
    """Registrations made by a test disappear after it; entry points are re-read on first use."""
    monkeypatch.setattr(models, "_ADAPTERS", dict(models._ADAPTERS))
    monkeypatch.setattr(models, "_entry_points_loaded", False)
    monkeypatch.setattr("importlib.metadata.entry_points", lambda group=None, **kw: [])


# --------------------------------------------------------------------- a family trl_flow knows nothing about
class ToyFlowPipeline(DiffusionPipeline):
    """A pipeline class of its own (not a subclass of any supported one): one CLIP text encoder, an MM-DiT and a
    VAE, sampled by flow-matching Euler without guidance."""

    def __init__(self, transformer, vae, scheduler, text_encoder, tokenizer):
        super().__init__()
        self.register_modules(transformer=transformer, vae=vae, scheduler=scheduler, text_encoder=text_encoder,
                              tokenizer=tokenizer)
        self.vae_scale_factor = 2 ** (len(vae.config.block_out_channels) - 1)


def toy_pipeline(seed: int = 0) -> ToyFlowPipeline:
    c = tiny_sd3_pipeline(seed=seed).components
    pipe = ToyFlowPipeline(c["transformer"], c["vae"], c["scheduler"], c["text_encoder"], c["tokenizer"])
    pipe.set_progress_bar_config(disable=True)
    return pipe


class ToyAdapter(FlowAdapter):
    """Written against the contract alone: CLIP hidden states (and pooled output) duplicated to the transformer's
    64 channels, the scheduler's own timesteps, one transformer pass (no guidance)."""

    default_lora_target_modules = ("attn.to_q", "attn.to_v")
    pipeline_class = StableDiffusion3Pipeline  # its save_lora_weights writes a transformer LoRA

    def encode_prompts(self, prompts, guidance, max_sequence_length):
        ids = self.pipe.tokenizer(list(prompts), padding="max_length", max_length=16, truncation=True,
                                  return_tensors="pt").input_ids.to(self.device)
        out = self.pipe.text_encoder(ids, output_hidden_states=True)
        hidden, pooled = out.hidden_states[-2], out.text_embeds
        return {"prompt_embeds": torch.cat([hidden, hidden], -1),
                "pooled_prompt_embeds": torch.cat([pooled, pooled], -1)}

    def schedule(self, num_inference_steps, height, width):
        self.pipe.scheduler.set_timesteps(num_inference_steps, device=self.device)
        return Schedule(sigmas=self.pipe.scheduler.sigmas.to(self.device, torch.float32).clone(),
                        timesteps=self.pipe.scheduler.timesteps.clone())

    def latent_shape(self, height, width):
        f = self.pipe.vae_scale_factor
        return (self.transformer.config.in_channels, height // f, width // f)

    def velocity(self, model, x, timestep, embeds, guidance_scale, detach_uncond=False):
        t = torch.as_tensor(timestep, device=x.device)
        t = t.expand(x.shape[0]) if t.ndim == 0 else t
        return model(hidden_states=x.to(self.transformer.dtype), timestep=t,
                     encoder_hidden_states=embeds["prompt_embeds"], pooled_projections=embeds["pooled_prompt_embeds"],
                     return_dict=False)[0].float()

    def decode(self, latents):
        vae = self.pipe.vae
        z = latents.to(vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor
        return (vae.decode(z, return_dict=False)[0].float() / 2 + 0.5).clamp(0, 1)


class OtherToyAdapter(ToyAdapter):
    pass


def test_unsupported_pipeline_error_names_the_guide_before_any_compute(tmp_path):
    assert "ToyFlowPipeline" not in registered_adapters()
    with pytest.raises(TypeError) as e:
        get_adapter(toy_pipeline())
    msg = str(e.value)
    assert "no trl_flow adapter for ToyFlowPipeline" in msg
    assert "register_adapter(ToyFlowPipeline, YourAdapter)" in msg and "docs/adding_a_model.md" in msg
    assert os.path.exists(os.path.join(ROOT, models.GUIDE))  # the error names a page that exists
    with pytest.raises(TypeError, match=re.escape("docs/adding_a_model.md")):
        FlowGRPOTrainer(tiny_config(tmp_path), toy_pipeline(), [brightness], train_dataset=PROMPTS)


def test_family_registered_from_outside_trains_and_saves(tmp_path):
    """register_adapter with the class -> an exported trainer trains it (the first ratio is exactly 1, the LoRA
    moves) and saves a LoRA that the pipeline loader reads."""
    register_adapter(ToyFlowPipeline, ToyAdapter)
    assert registered_adapters()["ToyFlowPipeline"] == "ToyAdapter"
    assert registered_adapters()["StableDiffusion3Pipeline"] == "SD3Adapter"  # built-ins untouched
    config = tiny_config(tmp_path, max_steps=2, learning_rate=1e-2, beta=0.01)
    trainer = FlowGRPOTrainer(config, toy_pipeline(), [brightness], train_dataset=PROMPTS)
    assert type(trainer.adapter) is ToyAdapter
    lora_modules = {n.rsplit(".lora_A", 1)[0] for n, _ in trainer.pipe.transformer.named_modules() if ".lora_A" in n}
    assert lora_modules and all(n.endswith(("attn.to_q", "attn.to_v")) for n in lora_modules)  # its own targets
    before = [p.detach().clone() for p in trainer.trainable_params]
    state = trainer.train()
    assert len(state.log_history) == 2
    for entry in state.log_history:
        assert entry["ratio_first_max_dev"] == 0.0 and entry["nonfinite_skipped"] == 0
    assert any(not torch.equal(b, p) for b, p in zip(before, trainer.trainable_params))
    path = trainer.save_model(str(tmp_path / "final"))
    fresh = tiny_sd3_pipeline()
    fresh.load_lora_weights(path)
    loaded = dict(fresh.transformer.named_parameters())
    trained = {n.replace(".default", ""): p for n, p in trainer.pipe.transformer.named_parameters() if "lora_" in n}
    assert trained and all(torch.equal(loaded[n.replace(".lora_A.", ".lora_A.default_0.").replace(
        ".lora_B.", ".lora_B.default_0.")], p) for n, p in trained.items())


def test_registration_by_name_matches_subclasses_nearest_first():
    """A subclass of a supported pipeline registered by name gets its own adapter (nearest class in the MRO);
    an unregistered subclass of it falls back to the same adapter; the base class keeps the built-in one."""
    MySD3 = type("MySD3Pipeline", (StableDiffusion3Pipeline,), {})
    Deeper = type("DeeperPipeline", (MySD3,), {})
    MySD3Adapter = type("MySD3Adapter", (SD3Adapter,), {})
    c = tiny_sd3_pipeline().components
    assert type(get_adapter(MySD3(**c))) is SD3Adapter  # before: the base class's adapter
    register_adapter("MySD3Pipeline", MySD3Adapter)
    assert type(get_adapter(MySD3(**c))) is MySD3Adapter
    assert type(get_adapter(Deeper(**c))) is MySD3Adapter
    assert type(get_adapter(StableDiffusion3Pipeline(**c))) is SD3Adapter


# ------------------------------------------------------------------------------------------------ bad input
def test_register_refuses_a_class_that_is_not_a_flow_adapter():
    for bad in (object, SD3Adapter(tiny_sd3_pipeline()), "trl_flow.models:SD3Adapter", None):
        with pytest.raises(TypeError, match=r"adapter_class must be a subclass of trl_flow\.models\.FlowAdapter.*"
                                            r"docs/adding_a_model\.md"):
            register_adapter(ToyFlowPipeline, bad)
    for bad in (42, None, ""):
        with pytest.raises(TypeError, match="pipeline_class must be a class or a class name"):
            register_adapter(bad, ToyAdapter)
    assert "ToyFlowPipeline" not in registered_adapters()  # nothing half-registered


def test_reregistering_needs_overwrite():
    register_adapter(ToyFlowPipeline, ToyAdapter)
    register_adapter("ToyFlowPipeline", ToyAdapter)  # the same adapter again: a no-op
    with pytest.raises(ValueError,
                       match=r"ToyFlowPipeline already has an adapter \(ToyAdapter\); pass overwrite=True"):
        register_adapter(ToyFlowPipeline, OtherToyAdapter)
    assert type(get_adapter(toy_pipeline())) is ToyAdapter  # the refused call changed nothing
    register_adapter(ToyFlowPipeline, OtherToyAdapter, overwrite=True)
    assert type(get_adapter(toy_pipeline())) is OtherToyAdapter
    # built-in families are protected the same way, lazy ones too (without importing their module)
    with pytest.raises(ValueError, match=r"StableDiffusion3Pipeline already has an adapter \(SD3Adapter\)"):
        register_adapter(StableDiffusion3Pipeline, ToyAdapter)
    lazy = models._ADAPTERS["QwenImagePipeline"]
    with pytest.raises(ValueError, match=r"QwenImagePipeline already has an adapter \(QwenImageAdapter\)"):
        register_adapter("QwenImagePipeline", ToyAdapter)
    assert models._ADAPTERS["QwenImagePipeline"] == lazy


# ------------------------------------------------------------------------------------------------ entry points
PLUGIN = '''
from trl_flow.models import SD3Adapter


class PluginAdapter(SD3Adapter):
    """An installed package's adapter, found through the trl_flow.adapters entry-point group."""


class NotAnAdapter:
    pass
'''


def _entry_points(monkeypatch, tmp_path, specs):
    (tmp_path / "toy_trl_flow_plugin.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    eps = [EntryPoint(name=n, value=v, group=models.ENTRY_POINT_GROUP) for n, v in specs]
    calls = []

    def entry_points(group=None, **kwargs):
        calls.append(group)
        return [ep for ep in eps if ep.group == group]

    monkeypatch.setattr("importlib.metadata.entry_points", entry_points)
    return calls


def test_entry_point_registers_a_family_on_first_lookup(monkeypatch, tmp_path):
    calls = _entry_points(monkeypatch, tmp_path, [
        ("PluginSD3Pipeline", "toy_trl_flow_plugin:PluginAdapter"),
        # entry points naming the adapter a pipeline already has (imported or still lazy) are quietly redundant
        ("StableDiffusion3Pipeline", "trl_flow.models.sd3:SD3Adapter"),
        ("QwenImagePipeline", "trl_flow.models.qwen_image:QwenImageAdapter"),
    ])
    monkeypatch.setitem(models._ADAPTERS, "QwenImagePipeline", ".qwen_image:QwenImageAdapter")  # not imported
    Plugin = type("PluginSD3Pipeline", (StableDiffusion3Pipeline,), {})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        adapter = get_adapter(Plugin(**tiny_sd3_pipeline().components))
    assert type(adapter).__name__ == "PluginAdapter" and calls == [models.ENTRY_POINT_GROUP]
    assert registered_adapters()["PluginSD3Pipeline"] == "PluginAdapter"
    assert calls == [models.ENTRY_POINT_GROUP]  # read once per process


def test_entry_point_family_trains(monkeypatch, tmp_path):
    _entry_points(monkeypatch, tmp_path, [("ToyFlowPipeline", "toy_trl_flow_plugin:PluginAdapter")])
    # the plug-in adapter is SD3's: give the toy pipeline SD3's encode_prompt by making it an SD3 subclass
    pipe = type("ToyFlowPipeline", (StableDiffusion3Pipeline,), {})(**tiny_sd3_pipeline().components)
    trainer = FlowGRPOTrainer(tiny_config(tmp_path, max_steps=1, learning_rate=1e-2), pipe, [brightness],
                              train_dataset=PROMPTS)
    assert type(trainer.adapter).__name__ == "PluginAdapter"
    before = [p.detach().clone() for p in trainer.trainable_params]
    assert trainer.train().log_history[-1]["ratio_first_max_dev"] == 0.0
    assert any(not torch.equal(b, p) for b, p in zip(before, trainer.trainable_params))


def test_broken_entry_points_warn_and_builtins_still_work(monkeypatch, tmp_path):
    _entry_points(monkeypatch, tmp_path, [
        ("MissingPipeline", "no_such_trl_flow_plugin_xyz:Adapter"),  # module not installed
        ("WrongPipeline", "toy_trl_flow_plugin:NotAnAdapter"),  # not a FlowAdapter
        ("StableDiffusion3Pipeline", "toy_trl_flow_plugin:PluginAdapter"),  # a built-in name: built-in wins
        ("PluginSD3Pipeline", "toy_trl_flow_plugin:PluginAdapter"),  # a good one beside the broken ones
    ])
    with pytest.warns(UserWarning) as record:
        sd3 = get_adapter(tiny_sd3_pipeline())
    messages = [str(w.message) for w in record]
    assert any("MissingPipeline" in m and "no_such_trl_flow_plugin_xyz" in m and "ModuleNotFoundError" in m
               for m in messages), messages
    assert any("WrongPipeline" in m and "FlowAdapter" in m for m in messages), messages
    assert any("StableDiffusion3Pipeline" in m and "already has an adapter" in m for m in messages), messages
    assert type(sd3) is SD3Adapter
    adapters = registered_adapters()
    assert adapters["StableDiffusion3Pipeline"] == "SD3Adapter" and adapters["FluxPipeline"] == "FluxAdapter"
    assert adapters["PluginSD3Pipeline"] == "PluginAdapter"
    assert "MissingPipeline" not in adapters and "WrongPipeline" not in adapters


# ------------------------------------------------------------------------------------------------ the guide
def guide_blocks() -> list[str]:
    text = open(GUIDE, encoding="utf-8").read()
    return [m.group(2) for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M) if m.group(1) == "python"]


def test_guide_code_runs(tmp_path, monkeypatch):
    """Every python block of docs/adding_a_model.md, in order, in one namespace: tiny pipeline, adapter,
    registration, ODE == pipe() bit for bit, LoRA targets, every trainer trains, LoRA round trip."""
    blocks = guide_blocks()
    assert len(blocks) >= 6
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "adding_a_model_guide"}
    for i, code in enumerate(blocks):
        exec(compile(code, f"{GUIDE}:python-block-{i + 1}", "exec"), namespace)
    assert registered_adapters()["MySD3Pipeline"] == "MySD3Adapter"
    assert (tmp_path / "out" / "final" / "pytorch_lora_weights.safetensors").exists()
    import trl_flow

    trainers = [c.__name__ for c in trl_flow.registered_trainers().values()]
    assert {"FlowGRPOTrainer", "OPGRPOTrainer", "FlowDPPOTrainer", "StepwiseFlowGRPOTrainer",
            "DiffusionNFTTrainer"} <= set(trainers)
    for name in trainers:  # every exported trainer trained (and wrote its run) in the guide's loop
        assert (tmp_path / "out" / name).is_dir(), name


def test_guide_adapter_matches_the_builtin_one():
    """The guide's adapter is the built-in SD3 one on SD3.5-style pipelines (no dynamic shifting): same schedule,
    embeddings and velocity, so the page cannot drift from the code it documents."""
    namespace = {"__name__": "adding_a_model_guide"}
    for code in guide_blocks()[:2]:  # the pipeline and the adapter
        exec(code, namespace)
    pipe = namespace["tiny_my_pipeline"]()
    ours, builtin = namespace["MySD3Adapter"](pipe), SD3Adapter(pipe)
    assert ours.default_lora_target_modules == builtin.default_lora_target_modules
    a, b = ours.schedule(4, HEIGHT, WIDTH), builtin.schedule(4, HEIGHT, WIDTH)
    assert torch.equal(a.sigmas, b.sigmas) and torch.equal(a.timesteps, b.timesteps)
    with torch.no_grad():
        ea, eb = ours.encode_prompts(PROMPTS[:2], True, MAX_SEQ), builtin.encode_prompts(PROMPTS[:2], True, MAX_SEQ)
        assert ea.keys() == eb.keys() and all(torch.equal(ea[k], eb[k]) for k in ea)
        x = ours.initial_noise(2, HEIGHT, WIDTH, torch.Generator().manual_seed(0))
        va = ours.velocity(pipe.transformer, x, a.timesteps[1], ea, 4.5)
        assert torch.equal(va, builtin.velocity(pipe.transformer, x, a.timesteps[1], eb, 4.5))
        assert torch.equal(ours.decode(x), builtin.decode(x))
