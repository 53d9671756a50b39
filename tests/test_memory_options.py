"""Memory options: offloading the text encoders and VAE between phases, micro-batched decode and reward calls, a
quantised base transformer (QLoRA style), 8-bit AdamW. (Gradient checkpointing: tests/test_trainer_options.py.)"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch
from conftest import PROMPTS, brightness, tiny_config

from trl_flow import FlowGRPOTrainer


def _lora(trainer):
    return {n: p.detach().clone() for n, p in trainer.pipe.transformer.named_parameters() if "lora_" in n}


def _record_moves(module, name, log):
    to = module.to

    def recording(*args, **kwargs):
        log.append((name, str(args[0]) if args else str(kwargs.get("device", kwargs.get("dtype")))))
        return to(*args, **kwargs)

    module.to = recording


def test_offload_moves_encoders_and_vae_per_phase_and_changes_nothing(make_trainer, tmp_path):
    base = make_trainer(output_dir=str(tmp_path / "a"), max_steps=1)
    off = make_trainer(output_dir=str(tmp_path / "b"), max_steps=1, offload="model")
    assert sorted(off.offloader.offloaded) == ["text_encoder", "text_encoder_2", "vae"]
    moves = []
    for name in off.offloader.offloaded:
        _record_moves(off.pipe.components[name], name, moves)
    base.train()
    off.train()
    device = str(off.device)
    # every phase brings its modules to the device and sends them back to the CPU
    assert moves[:4] == [("text_encoder", device), ("text_encoder_2", device), ("text_encoder", "cpu"),
                         ("text_encoder_2", "cpu")]
    assert ("vae", device) in moves and moves[-1] == ("vae", "cpu")
    assert moves.count(("vae", device)) == moves.count(("vae", "cpu")) >= 1
    torch.testing.assert_close(off.last_rollout.states, base.last_rollout.states, atol=0, rtol=0)
    la, lb = _lora(base), _lora(off)
    assert all(torch.equal(la[n], lb[n]) for n in la)


def test_offload_is_shared_by_threads():
    """reward_num_workers decode from worker threads: the VAE goes back to the CPU only when the last one is done."""
    import threading

    from trl_flow.memory import Offloader

    vae, moves = torch.nn.Linear(2, 2), []
    _record_moves(vae, "vae", moves)
    off = Offloader(SimpleNamespace(components={"vae": vae, "transformer": torch.nn.Linear(2, 2)}), "model", "cpu")
    inside, release = threading.Barrier(3), threading.Event()

    def decode():
        with off.use("vae"):
            inside.wait()
            release.wait()

    threads = [threading.Thread(target=decode) for _ in range(2)]
    for t in threads:
        t.start()
    inside.wait()  # both threads hold the VAE
    assert moves == [("vae", "cpu")]  # brought to the device once
    release.set()
    for t in threads:
        t.join()
    assert moves == [("vae", "cpu"), ("vae", "cpu")]  # and back once, after both


def test_decode_and_rewards_are_micro_batched(make_trainer):
    sizes = {"decode": [], "reward": []}

    def sized_reward(images, prompts, **kw):
        sizes["reward"].append(len(prompts))
        return brightness(images, prompts)

    tr = make_trainer(rewards=[sized_reward], per_device_train_batch_size=3, per_device_reward_batch_size=5)
    tr.pipe.vae.decoder.register_forward_hook(lambda m, args, out: sizes["decode"].append(args[0].shape[0]))
    sizes["reward"].clear()
    rollout = tr.make_rollout(0)
    assert sizes["decode"] == [3, 3, 2] and sizes["reward"] == [5, 3]
    whole, _ = tr.reward(rollout.images, rollout.prompts, rollout.columns)
    tr.config.per_device_reward_batch_size = None
    assert torch.equal(whole, tr.reward(rollout.images, rollout.prompts, rollout.columns)[0])


def _flag_quantized(module, method):
    """What diffusers sets on a model loaded with a quantization_config (without quantising anything)."""
    module.is_quantized = True
    module.quantization_config = SimpleNamespace(quant_method=method)


@pytest.fixture
def fresh_accelerate_state():
    """accelerate keeps one AcceleratorState per process and refuses a second mixed-precision setting."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def test_quantized_transformer_is_not_cast_and_trains_a_float32_lora(tmp_path, fresh_pipe, fresh_accelerate_state):
    pipe = fresh_pipe()
    _flag_quantized(pipe.transformer, "gguf")
    with pytest.raises(ValueError, match="Casting a quantized model"):  # what diffusers refuses
        pipe.transformer.to(dtype=torch.bfloat16)
    tr = FlowGRPOTrainer(tiny_config(tmp_path, bf16=True, max_steps=1), pipe, [brightness], train_dataset=PROMPTS)
    base = [p for n, p in tr.pipe.transformer.named_parameters() if "lora_" not in n]
    assert all(p.dtype == torch.float32 for p in base)  # the quantised module keeps its storage dtype
    assert tr.pipe.vae.dtype == torch.bfloat16  # the others are cast as usual
    before = _lora(tr)
    tr.train()
    after = _lora(tr)
    assert all(v.dtype == torch.float32 for v in after.values())
    assert any(not torch.equal(after[n], before[n]) for n in after)


def test_quantized_transformer_errors(tmp_path, fresh_pipe):
    pipe = fresh_pipe()
    _flag_quantized(pipe.transformer, "gguf")
    with pytest.raises(ValueError, match="finetune='full'.*quantised.*QLoRA"):
        FlowGRPOTrainer(tiny_config(tmp_path, finetune="full"), pipe, [brightness], train_dataset=PROMPTS)
    pipe = fresh_pipe()
    _flag_quantized(pipe.transformer, "bitsandbytes")
    if importlib.util.find_spec("bitsandbytes") is None:
        with pytest.raises(ImportError, match="pip install bitsandbytes"):
            FlowGRPOTrainer(tiny_config(tmp_path), pipe, [brightness], train_dataset=PROMPTS)
    elif not torch.cuda.is_available():
        with pytest.raises(ValueError, match="bitsandbytes.*CUDA"):
            FlowGRPOTrainer(tiny_config(tmp_path), pipe, [brightness], train_dataset=PROMPTS)
    assert not getattr(pipe.transformer, "peft_config", None)  # refused before the model was touched


def test_adamw_8bit(make_trainer, fresh_pipe, tmp_path):
    if importlib.util.find_spec("bitsandbytes") is None:
        pipe = fresh_pipe()
        with pytest.raises(ImportError, match="adamw_8bit.*pip install bitsandbytes"):
            FlowGRPOTrainer(tiny_config(tmp_path, optim="adamw_8bit"), pipe, [brightness], train_dataset=PROMPTS)
        assert not getattr(pipe.transformer, "peft_config", None)
        pytest.skip("bitsandbytes is not installed: only its clear error is tested here")
    full = make_trainer(optim="adamw_8bit", max_steps=2, output_dir=str(tmp_path / "full"))
    before = _lora(full)
    full.train()
    assert any(not torch.equal(v, before[n]) for n, v in _lora(full).items())
    make_trainer(optim="adamw_8bit", max_steps=1, save_steps=1).train()
    resumed = make_trainer(optim="adamw_8bit", max_steps=2)  # its 8-bit state loads with weights_only=True
    resumed.train(resume_from_checkpoint=True)
    a, b = _lora(full), _lora(resumed)
    assert all(torch.equal(a[n], b[n]) for n in a)
