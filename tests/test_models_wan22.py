"""Wan2.2 through ``WanPipeline``: the A14B two-expert form (``transformer`` / ``transformer_2`` switched at
``boundary_ratio``, ``guidance_scale_2``) and the TI2V-5B ``expand_timesteps`` form, on tiny random pipelines.

ODE rollout == ``pipe()`` bit for bit (and the switch on the pipeline's step), every trainer trains the trained
expert(s) and leaves a frozen one untouched, LoRA round trip through ``load_lora_weights`` (with
``load_into_transformer_2``), checkpoint/resume exact with both experts, bad settings fail before compute."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from conftest import MAX_SEQ, PROMPTS
from test_models_families import exported_trainers, video_or_image_brightness

from trl_flow.testing import tiny_wan22_5b_pipeline, tiny_wan22_pipeline

SIZES = {"a14b": (32, 32), "5b": (64, 32)}  # the 5B VAE compresses space by 16 (x patch 2: multiples of 32)
FORMS = tuple(SIZES)


def make_pipe(form, **kwargs):
    return tiny_wan22_pipeline(**kwargs) if form == "a14b" else tiny_wan22_5b_pipeline(**kwargs)


@pytest.fixture(autouse=True)
def _quiet_scheduler_swap(monkeypatch):
    import trl_flow.models.wan as wan

    monkeypatch.setattr(wan, "_SCHEDULER_SWAP_WARNED", True)


@pytest.fixture
def fresh_accelerate_state():
    """accelerate keeps one AcceleratorState per process and refuses a second mixed-precision setting."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def wan22_config(config_class, tmp_path, form, **overrides):
    H, W = SIZES[form]
    kwargs = dict(
        output_dir=str(tmp_path / "out"), max_steps=2, num_generations=2, prompts_per_step=2,
        per_device_train_batch_size=4, height=H, width=W, max_sequence_length=MAX_SEQ, num_inference_steps=4,
        eval_num_inference_steps=4, per_device_eval_batch_size=4, guidance_scale=4.0, lora_r=4, lora_alpha=8,
        learning_rate=1e-2, clip_range=5e-2, beta=0.01, disable_tqdm=True, num_frames=5,
    )
    fields = {f.name for f in dataclasses.fields(config_class)}
    kwargs = {k: v for k, v in kwargs.items() if k in fields}  # DiffusionNFT has no clip_range
    if form == "a14b":
        kwargs["guidance_scale_2"] = 3.0
    kwargs.update(overrides)
    return config_class(**kwargs)


class _Recorder:
    """Wraps both experts' forward to record which one served each call (in call order)."""

    def __init__(self, pipe):
        self.calls = []
        for name in ("transformer", "transformer_2"):
            module = getattr(pipe, name)
            forward = module.forward

            def wrapped(*args, _name=name, _forward=forward, **kwargs):
                self.calls.append((_name, float(kwargs["timestep"].reshape(-1)[0])))
                return _forward(*args, **kwargs)

            module.forward = wrapped


# --------------------------------------------------------------------------------------------- pipeline parity
PARITY = [
    # (form, guidance_scale, guidance_scale_2, negative prompt)
    ("a14b", 4.0, 3.0, "blurry"),  # CFG, a different scale on each expert: two passes per step
    ("a14b", 1.0, None, None),  # no CFG: one pass per step, still two experts
    ("5b", 5.0, None, "blurry"),
    ("5b", 1.0, None, None),
]


@pytest.mark.parametrize("form,guidance_scale,guidance_scale_2,negative", PARITY,
                         ids=["a14b-cfg", "a14b", "5b-cfg", "5b"])
def test_ode_rollout_reproduces_pipeline_exactly(form, guidance_scale, guidance_scale_2, negative):
    """The `ode` kernel ends exactly where pipe(output_type="latent") ends, through the same expert at every step
    (A14B: both serve some steps); the adapter's decode is the pipeline's decoded output."""
    from trl_flow.models import get_adapter
    from trl_flow.rollout import sample_trajectories

    H, W = SIZES[form]
    pipe = make_pipe(form)
    options = {"num_frames": 5, "guidance_scale_2": guidance_scale_2}
    if negative is not None:
        options["negative_prompt"] = negative
    adapter = get_adapter(pipe, **options)
    prompts, K = PROMPTS[:3], 6
    call = dict(height=H, width=W, num_frames=5, num_inference_steps=K, guidance_scale=guidance_scale,
                max_sequence_length=MAX_SEQ)
    if guidance_scale_2 is not None:
        call["guidance_scale_2"] = guidance_scale_2
    if negative is not None:
        call["negative_prompt"] = [negative] * len(prompts)
    recorder = _Recorder(pipe) if form == "a14b" else None
    expected = pipe(prompts, generator=torch.Generator().manual_seed(3), output_type="latent", **call).frames
    noise = adapter.initial_noise(len(prompts), H, W, torch.Generator().manual_seed(3))
    with torch.no_grad():
        embeds = adapter.encode_prompts(prompts, guidance_scale > 1, MAX_SEQ)
    schedule = adapter.schedule(K, H, W)
    if recorder is not None:
        pipe_calls, recorder.calls = recorder.calls, []
    traj = sample_trajectories(adapter, adapter.trainable_module(), embeds, noise, schedule, ["ode"] * K, 0.0,
                               guidance_scale, batch_size=len(prompts))
    final = traj["states"][:, -1]
    z = 4 if form == "a14b" else 8
    assert final.shape == (3, z, 2, H // (8 if form == "a14b" else 16), W // (8 if form == "a14b" else 16))
    assert torch.equal(final, expected)
    if recorder is not None:
        assert recorder.calls == pipe_calls
        used = [name for name, _ in pipe_calls]
        assert "transformer" in used and "transformer_2" in used  # the switch falls inside the schedule
    decoded = pipe(prompts, generator=torch.Generator().manual_seed(3), output_type="pt", **call).frames
    with torch.no_grad():
        ours = adapter.decode(final)
    assert ours.shape == (3, *adapter.output_shape(H, W)) and torch.equal(ours, decoded)


def test_switch_lands_on_the_pipelines_step_at_the_boundary():
    """The pipeline compares its float32 timestep tensor with the Python boundary (``t >= boundary_timestep``), which
    torch evaluates in float32: a timestep equal to the boundary in float32 but below it in float64 goes to the
    high-noise expert. The adapter's routing compares the same way (a Python-float comparison would not)."""
    from trl_flow.models import wan22

    pipe = tiny_wan22_pipeline(boundary_ratio=0.9 + 1e-13)
    boundary = wan22.boundary_timestep(pipe)
    assert 900.0 < boundary and float(torch.tensor(boundary, dtype=torch.float32)) == 900.0  # the trap
    t = torch.tensor([900.0, 899.9, 1000.0])
    assert [bool(x >= boundary) for x in t] == [True, False, True]  # the pipeline's per-step expression
    assert wan22.expert_of(t, boundary).tolist() == [True, False, True]


def test_mixed_batch_routes_each_sample_to_its_expert():
    """Per-sample timesteps on both sides of the boundary (Stepwise's substeps): each row equals that row alone."""
    from trl_flow.models import get_adapter

    pipe = tiny_wan22_pipeline()
    adapter = get_adapter(pipe, num_frames=5, guidance_scale_2=2.0)
    with torch.no_grad():
        embeds = adapter.encode_prompts(PROMPTS[:2], True, MAX_SEQ)
        x = adapter.initial_noise(2, 32, 32, torch.Generator().manual_seed(0))
        t = torch.tensor([950.0, 300.0])
        both = adapter.velocity(pipe.transformer, x, t, embeds, 4.0)
        for i in range(2):
            alone = adapter.velocity(pipe.transformer, x[i : i + 1], t[i : i + 1],
                                     {k: v[i : i + 1] for k, v in embeds.items()}, 4.0)
            assert torch.allclose(both[i], alone[0], atol=1e-6)
        low_as_high = adapter.velocity(pipe.transformer, x[1:], torch.tensor([950.0]),
                                       {k: v[1:] for k, v in embeds.items()}, 4.0)
    assert not torch.allclose(both[1], low_as_high[0])


@pytest.mark.parametrize("form", FORMS)
def test_load_pipeline_round_trip(tmp_path, form):
    """save_pretrained -> load_pipeline keeps the Wan2.2 form (both experts and boundary_ratio, or
    expand_timesteps): the loaded pipeline's adapter samples exactly as the original's."""
    from trl_flow.models import get_adapter, load_pipeline
    from trl_flow.rollout import sample_trajectories

    H, W = SIZES[form]
    pipes = [make_pipe(form)]
    pipes[0].save_pretrained(tmp_path / "pipe")
    pipes.append(load_pipeline(str(tmp_path / "pipe")))
    finals = []
    for pipe in pipes:
        adapter = get_adapter(pipe, num_frames=5)
        assert adapter.two_experts == (form == "a14b")
        assert bool(pipe.config.get("expand_timesteps")) == (form == "5b")
        with torch.no_grad():
            embeds = adapter.encode_prompts(PROMPTS[:2], True, MAX_SEQ)
        noise = adapter.initial_noise(2, H, W, torch.Generator().manual_seed(0))
        traj = sample_trajectories(adapter, adapter.trainable_module(), embeds, noise, adapter.schedule(4, H, W),
                                   ["ode"] * 4, 0.0, 4.0, batch_size=2)
        finals.append(traj["states"][:, -1])
    assert torch.equal(finals[0], finals[1])


# ---------------------------------------------------------------------------------------------- every trainer
def _weights(module):
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def _changed(before, module):
    now = dict(module.named_parameters())
    return [n for n in before if not torch.equal(before[n], now[n].detach())]


def _train_cases():
    """Every exported trainer on both forms with every expert trained; the single-expert choices (the adapter's,
    shared by all trainers) on Flow-GRPO."""
    import trl_flow

    cases = [(form, "all", cls) for form in FORMS for cls in exported_trainers()]
    return cases + [("a14b", experts, trl_flow.FlowGRPOTrainer) for experts in ("high_noise", "low_noise")]


@pytest.mark.parametrize("form,experts,trainer_class", _train_cases(), ids=lambda v: getattr(v, "__name__", v))
def test_every_trainer_trains_the_chosen_experts(tmp_path, form, experts, trainer_class):
    """Two iterations; the first ratio of each is exactly 1; the LoRA of every trained expert moves; a frozen
    expert gets no LoRA and keeps every weight; rewards get (B, F, 3, H, W) videos."""
    seen = []

    def reward(images, prompts, **columns):
        seen.append(tuple(images.shape))
        return video_or_image_brightness(images, prompts)

    pipe = make_pipe(form)
    H, W = SIZES[form]
    config = wan22_config(trainer_class.config_class, tmp_path, form, experts=experts,
                          **({"num_inference_steps": 6} if experts == "high_noise" else {}))
    frozen = {n: _weights(getattr(pipe, n)) for n in ("transformer", "transformer_2")
              if getattr(pipe, n, None) is not None}
    trainer = trainer_class(config, pipe, [reward], train_dataset=PROMPTS)
    trained = trainer.adapter.trained_components()
    assert trained == {"all": ("transformer", "transformer_2") if form == "a14b" else ("transformer",),
                       "high_noise": ("transformer",), "low_noise": ("transformer_2",)}[experts]
    lora = {n: {k: v.detach().clone() for k, v in getattr(pipe, n).named_parameters() if "lora_" in k}
            for n in trained}
    state = trainer.train()
    assert all(s[1:] == (5, 3, H, W) for s in seen)
    assert len(state.log_history) == 2
    for entry in state.log_history:
        assert entry.get("ratio_first_max_dev", 0.0) == 0.0  # (a method without a ratio logs none)
        assert entry.get("kl_old_first_max", 0.0) == 0.0
        assert torch.isfinite(torch.tensor(entry["loss"])) and entry["nonfinite_skipped"] == 0
    for name in trained:
        now = dict(getattr(pipe, name).named_parameters())
        assert lora[name] and any(not torch.equal(v, now[k]) for k, v in lora[name].items()), name
    for name in set(frozen) - set(trained):
        module = getattr(pipe, name)
        assert not getattr(module, "peft_config", None) and not _changed(frozen[name], module), name


def test_frozen_experts_steps_are_deterministic_and_untrained(tmp_path):
    """experts='low_noise': the high-noise expert's steps use the ODE kernel (std 0) and are not in the trained
    steps; KL to the reference there is exactly 0."""
    from trl_flow import FlowGRPOConfig, FlowGRPOTrainer
    from trl_flow.models import wan22

    config = wan22_config(FlowGRPOConfig, tmp_path, "a14b", experts="low_noise", num_inference_steps=6, max_steps=1)
    trainer = FlowGRPOTrainer(config, make_pipe("a14b"), [video_or_image_brightness], train_dataset=PROMPTS)
    trainer.train()
    rollout = trainer.last_rollout
    high = wan22.expert_of(rollout.schedule.timesteps, wan22.boundary_timestep(trainer.pipe)).tolist()
    assert any(high) and not all(high)
    kinds = rollout.extras["step_kinds"]
    assert [kinds[k] == "ode" for k in range(len(high)) if high[k]] == [True] * sum(high)
    assert all(k not in rollout.trained_steps() for k in range(len(high)) if high[k])
    assert rollout.trained_steps()  # the low-noise steps (but the last) are trained


def test_full_finetune_of_one_expert(tmp_path):
    """finetune='full', experts='high_noise', beta > 0: the frozen reference copy holds the trained expert only;
    the high-noise expert's weights move, the low-noise expert's do not; save_model writes the whole pipeline."""
    from diffusers import WanPipeline

    from trl_flow import FlowGRPOConfig, FlowGRPOTrainer

    pipe = make_pipe("a14b")
    before = {n: _weights(getattr(pipe, n)) for n in ("transformer", "transformer_2")}
    config = wan22_config(FlowGRPOConfig, tmp_path, "a14b", finetune="full", experts="high_noise",
                          num_inference_steps=6, max_steps=1, learning_rate=1e-3)
    trainer = FlowGRPOTrainer(config, pipe, [video_or_image_brightness], train_dataset=PROMPTS)
    assert trainer.ref_model.names == ("transformer",)
    assert {id(p) for p in trainer.trainable_params} == {id(p) for p in pipe.transformer.parameters()}
    trainer.train()
    assert _changed(before["transformer"], pipe.transformer)
    assert not _changed(before["transformer_2"], pipe.transformer_2)
    out = trainer.save_model(str(tmp_path / "final"))
    saved = WanPipeline.from_pretrained(out)
    for name in ("transformer", "transformer_2"):
        want = getattr(pipe, name).state_dict()
        assert all(torch.equal(v, want[k]) for k, v in getattr(saved, name).state_dict().items()), name


@pytest.mark.parametrize("experts,float32",
                         [("low_noise", ("transformer_2",)), ("all", ("transformer", "transformer_2"))])
def test_bf16_full_finetune_keeps_the_trained_experts_in_float32(tmp_path, experts, float32, fresh_accelerate_state):
    """Mixed precision: the trained expert(s) keep float32 weights, a frozen expert is cast to bf16 like the other
    frozen components."""
    from trl_flow import FlowGRPOConfig, FlowGRPOTrainer

    config = wan22_config(FlowGRPOConfig, tmp_path, "a14b", finetune="full", experts=experts, bf16=True,
                          num_inference_steps=6)
    trainer = FlowGRPOTrainer(config, make_pipe("a14b"), [video_or_image_brightness], train_dataset=PROMPTS)
    for name in ("transformer", "transformer_2"):
        want = torch.float32 if name in float32 else torch.bfloat16
        assert {p.dtype for p in getattr(trainer.pipe, name).parameters()} == {want}, name


# ---------------------------------------------------------------------------------------------- LoRA round trip
@pytest.mark.parametrize("form,experts", [("a14b", "all"), ("a14b", "low_noise"), ("5b", "all")])
def test_lora_round_trips_through_pipeline_loader(tmp_path, form, experts):
    """save_model writes one diffusers file per trained expert; a fresh pipeline's load_lora_weights (the second
    expert's with load_into_transformer_2=True, the snippet of the model card) samples exactly as the trained one."""
    from trl_flow import FlowGRPOConfig, FlowGRPOTrainer
    from trl_flow.models import get_adapter

    config = wan22_config(FlowGRPOConfig, tmp_path, form, max_steps=1, beta=0.0, experts=experts)
    trainer = FlowGRPOTrainer(config, make_pipe(form), [video_or_image_brightness], train_dataset=PROMPTS)
    trainer.train()
    out = trainer.save_model(str(tmp_path / "final"))
    names = trainer.adapter.lora_weight_names()
    assert sorted(n for n in os.listdir(out) if n.endswith(".safetensors")) == sorted(names)
    assert len(names) == len(trainer.adapter.trained_components())
    from trl_flow.hub import upload_patterns
    from trl_flow.engine.output_dir import earlier_outputs

    assert set(names) <= set(upload_patterns(trainer, False))  # a push uploads every expert's file
    assert set(names) <= set(earlier_outputs(out, "another-run"))  # and a new run refuses a folder holding them
    fresh = make_pipe(form)
    get_adapter(fresh)  # the same scheduler swap the trained pipeline got
    H, W = SIZES[form]
    call = dict(prompt=["a cat"], height=H, width=W, num_frames=5, num_inference_steps=4, guidance_scale=4.0,
                max_sequence_length=MAX_SEQ, output_type="latent",
                **({"guidance_scale_2": 3.0} if form == "a14b" else {}))

    def run(p):
        with torch.no_grad():
            return p(generator=torch.Generator().manual_seed(0), **call).frames

    base = run(fresh)
    exec(trainer.adapter.lora_load_code(out), {"pipe": fresh})
    loaded, trained = run(fresh), run(trainer.pipe)
    assert torch.equal(loaded, trained)
    assert (loaded - base).abs().max() > 1e-4  # the LoRA is not a no-op
    if experts == "low_noise":
        assert not getattr(fresh.transformer, "peft_config", None)  # nothing loaded into the high-noise expert


# ------------------------------------------------------------------------------------------- checkpoint/resume
def test_resume_with_both_experts_is_exact(tmp_path):
    """A run stopped after its checkpoint-1 and resumed in a fresh trainer ends with exactly the uninterrupted
    run's LoRA of both experts, EMA and logged rewards."""
    from safetensors.torch import load_file

    from trl_flow import FlowGRPOConfig, FlowGRPOTrainer
    from trl_flow.models import wan22

    def make(out, max_steps):
        config = wan22_config(FlowGRPOConfig, tmp_path, "a14b", output_dir=str(tmp_path / out), max_steps=max_steps,
                              save_steps=1, ema_decay=0.5)
        return FlowGRPOTrainer(config, make_pipe("a14b"), [video_or_image_brightness], train_dataset=PROMPTS)

    ref = make("ref", 2)
    ref.train()
    make("resumed", 1).train()
    ckpt = tmp_path / "resumed" / "checkpoint-1"
    assert {*wan22.LORA_FILES.values(), "ema.safetensors"} <= set(os.listdir(ckpt))
    resumed = make("resumed", 2)
    resumed.train(resume_from_checkpoint=True)
    for name in wan22.LORA_FILES.values():
        got = load_file(str(tmp_path / "resumed" / "checkpoint-2" / name))
        want = load_file(str(tmp_path / "ref" / "checkpoint-2" / name))
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), name
    got = load_file(str(tmp_path / "resumed" / "checkpoint-2" / "ema.safetensors"))
    want = load_file(str(tmp_path / "ref" / "checkpoint-2" / "ema.safetensors"))
    assert any(k.startswith("transformer_2.") for k in want) and all(torch.equal(got[k], want[k]) for k in want)
    assert [e["reward"] for e in resumed.state.log_history] == [e["reward"] for e in ref.state.log_history]
    # the two experts' LoRAs differ (each expert was trained on its own steps)
    a = load_file(str(tmp_path / "ref" / "checkpoint-2" / wan22.LORA_FILES["transformer"]))
    b = load_file(str(tmp_path / "ref" / "checkpoint-2" / wan22.LORA_FILES["transformer_2"]))
    assert a.keys() == b.keys() and any(not torch.equal(a[k], b[k]) for k in a)


def test_resume_with_other_experts_is_refused(tmp_path):
    from trl_flow import FlowGRPOConfig, FlowGRPOTrainer

    def make(**kw):
        config = wan22_config(FlowGRPOConfig, tmp_path, "a14b", save_steps=1, **kw)
        return FlowGRPOTrainer(config, make_pipe("a14b"), [video_or_image_brightness], train_dataset=PROMPTS)

    make(max_steps=1).train()
    with pytest.raises(ValueError, match="experts: 'all' -> 'low_noise'"):
        make(max_steps=2, experts="low_noise").load_checkpoint(str(tmp_path / "out" / "checkpoint-1"))


def _ddp_run(out: str) -> None:
    """Run by torchrun (2 CPU processes): both experts trained, one SDE step per rollout, so an iteration's backward
    runs one expert only."""
    from trl_flow import FlowGRPOConfig, FlowGRPOTrainer

    config = FlowGRPOConfig(output_dir=out, max_steps=4, num_generations=2, prompts_per_step=2,
                            per_device_train_batch_size=2, height=32, width=32, max_sequence_length=MAX_SEQ,
                            num_inference_steps=6, guidance_scale=4.0, guidance_scale_2=3.0, lora_r=4, lora_alpha=8,
                            learning_rate=1e-2, clip_range=5e-2, beta=0.0, disable_tqdm=True, num_frames=5,
                            sde_window_size=1, sde_window_range=4, save_steps=4)
    FlowGRPOTrainer(config, tiny_wan22_pipeline(), [video_or_image_brightness], train_dataset=PROMPTS).train()


@pytest.mark.slow
def test_both_experts_train_under_ddp_with_two_processes(tmp_path):
    """Each step runs one expert, so DDP must look for unused parameters (the adapter's partial_forward): without
    it the second iteration fails ("Expected to have finished reduction in the prior iteration")."""
    import socket
    import subprocess
    import sys

    from safetensors.torch import load_file

    from trl_flow.models import wan22

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", ACCELERATE_USE_CPU="1")
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(here), here, env.get("PYTHONPATH", "")])
    out = tmp_path / "ddp"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(port), os.path.abspath(__file__), str(out)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in wan22.LORA_FILES.values():  # lora_B starts at 0: each expert was trained in some iteration
        sd = load_file(str(out / "checkpoint-4" / name))
        assert max(float(v.abs().max()) for k, v in sd.items() if "lora_B" in k) > 0, name


# ------------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("form,overrides,match", [
    ("5b", {"experts": "high_noise"}, "experts='high_noise': this WanPipeline has one transformer"),
    ("5b", {"guidance_scale_2": 3.0}, "guidance_scale_2=3.0: it guides Wan2.2's low-noise expert"),
    ("5b", {"height": 48}, "multiples of 32"),
    ("a14b", {"experts": "low_noise", "num_inference_steps": 2}, "experts='low_noise': no step but the last"),
    ("a14b", {"num_frames": 6}, "num_frames=6: Wan needs 4k \\+ 1"),
])
def test_bad_config_fails_before_compute(tmp_path, form, overrides, match):
    from trl_flow import FlowGRPOConfig, FlowGRPOTrainer

    calls = []
    config = wan22_config(FlowGRPOConfig, tmp_path, form, **overrides)
    with pytest.raises(ValueError, match=match):
        FlowGRPOTrainer(config, make_pipe(form), [lambda im, p, **c: calls.append(1) or [0.0] * len(p)],
                        train_dataset=PROMPTS)
    assert calls == []


def test_bad_values_are_refused_by_the_config_and_the_adapter(tmp_path):
    from trl_flow import FlowGRPOConfig
    from trl_flow.models import WanAdapter

    with pytest.raises(ValueError, match="FlowGRPOConfig.experts='both': must be one of"):
        FlowGRPOConfig(experts="both")
    with pytest.raises(ValueError, match="guidance_scale_2=-1"):
        FlowGRPOConfig(guidance_scale_2=-1.0)
    from trl_flow import FlowGRPOTrainer

    adapter = WanAdapter(tiny_wan22_pipeline(), experts="high_noise")  # a configured adapter keeps its choice
    trainer = FlowGRPOTrainer(FlowGRPOConfig(output_dir=str(tmp_path / "a"), height=32, width=32, num_frames=5,
                                             num_inference_steps=6, max_sequence_length=MAX_SEQ, disable_tqdm=True),
                              adapter, [video_or_image_brightness], train_dataset=PROMPTS)
    assert trainer.adapter.trained_components() == ("transformer",)
    with pytest.raises(ValueError, match="experts='low_noise' in the config, but the WanAdapter was built with"):
        adapter.configure(FlowGRPOConfig(experts="low_noise", num_frames=5))
    pipe = tiny_wan22_pipeline()
    pipe.transformer_2 = None
    with pytest.raises(ValueError, match="boundary_ratio is set but transformer_2 is None"):
        WanAdapter(pipe)


# ---------------------------------------------------------------------------------------------------- recipes
@pytest.mark.parametrize("recipe,form", [("wan22_t2v_a14b_flow_grpo", "a14b"), ("wan22_ti2v_5b_flow_grpo", "5b")])
def test_recipe_settings_train_on_the_tiny_pipeline(tmp_path, recipe, form):
    """The recipe's Wan2.2 settings (experts, both guidance scales, LoRA targets, SDE window, noise) train one
    iteration on the tiny pipeline of its form, at a tiny size and batch; every trained expert gets every target."""
    import dataclasses

    from trl_flow import FlowGRPOTrainer, cli

    _, config, _ = cli.parse_args("grpo", ["--config", recipe])
    H, W = SIZES[form]
    config = dataclasses.replace(
        config, output_dir=str(tmp_path / "out"), height=H, width=W, num_frames=5, max_sequence_length=MAX_SEQ,
        num_generations=2, prompts_per_step=2, per_device_train_batch_size=2, gradient_accumulation_steps=1,
        max_steps=1, bf16=False, gradient_checkpointing=False, disable_tqdm=True, eval_num_inference_steps=4,
        per_device_eval_batch_size=2)
    trainer = FlowGRPOTrainer(config, make_pipe(form), [video_or_image_brightness], train_dataset=PROMPTS)
    assert trainer.adapter.guidance_scale_2 == config.guidance_scale_2
    state = trainer.train()
    assert state.global_step == 1 and state.log_history[0]["ratio_first_max_dev"] == 0.0
    targets = config.lora_target_modules or list(trainer.adapter.default_lora_target_modules)
    for name in trainer.adapter.trained_components():
        adapted = {n.rsplit(".lora_", 1)[0] for n, _ in getattr(trainer.pipe, name).named_parameters()
                   if ".lora_" in n}
        assert all(any(a.endswith(t) for a in adapted) for t in targets), (name, targets)


if __name__ == "__main__":  # the 2-process worker of test_both_experts_train_under_ddp_with_two_processes
    import sys

    torch.set_num_threads(1)
    _ddp_run(sys.argv[1])
