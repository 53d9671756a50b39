"""``attention_backend`` and ``compile_repeated_blocks``: set on the trained transformer at set-up; ``native``
changes nothing; bad names and backends that cannot run here are refused before compute."""

from __future__ import annotations

import time

import pytest
import torch

from trl_flow import FlowGRPOConfig


def _lora(trainer):
    return {n: p.detach().clone() for n, p in trainer.pipe.transformer.named_parameters() if "lora" in n}


def test_native_backend_is_set_and_changes_nothing(make_trainer, tmp_path):
    plain = make_trainer(output_dir=str(tmp_path / "plain"))
    plain.train()
    native = make_trainer(output_dir=str(tmp_path / "native"), attention_backend="native")
    backends = {getattr(m.processor, "_attention_backend", None) for m in native.pipe.transformer.modules()
                if hasattr(m, "processor") and hasattr(m.processor, "_attention_backend")}
    assert backends <= {"native"} or {str(b) for b in backends} <= {"AttentionBackendName.NATIVE"}
    native.train()
    a, b = _lora(plain), _lora(native)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for x, y in zip(plain.state.log_history, native.state.log_history, strict=True):
        assert x["loss"] == y["loss"] and x["reward"] == y["reward"]


def test_bad_attention_backend_is_refused(make_trainer):
    with pytest.raises(ValueError, match=r"attention_backend='fa3': unknown backend; one of \[.*'native'"):
        FlowGRPOConfig(attention_backend="fa3")
    with pytest.raises(ValueError, match="attention_backend='flash': needs an accelerator"):
        make_trainer(attention_backend="flash")


@pytest.mark.slow  # ~80 s on 2 CPU cores: the compilation
def test_compile_repeated_blocks_trains_close_to_eager(make_trainer, tmp_path):
    eager = make_trainer(output_dir=str(tmp_path / "eager"), max_steps=1)
    eager.train()
    t0 = time.perf_counter()
    compiled = make_trainer(output_dir=str(tmp_path / "compiled"), max_steps=1, compile_repeated_blocks=True)
    assert any(hasattr(m, "_compiled_call_impl") and m._compiled_call_impl is not None
               for m in compiled.pipe.transformer.transformer_blocks)
    compiled.train()
    e, c = eager.state.log_history[0], compiled.state.log_history[0]
    print(f"compiled run: {time.perf_counter() - t0:.1f} s, ratio_first_max_dev {c['ratio_first_max_dev']:.3g} "
          f"(eager {e['ratio_first_max_dev']:.3g}), loss {c['loss']!r} vs {e['loss']!r}")
    assert c["ratio_first_max_dev"] < 1e-4 and abs(c["loss"] - e["loss"]) < 1e-4
