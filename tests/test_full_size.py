"""benchmarks/full_size.py: ``--tiny`` runs every available family end to end on the CPU (rollout vs pipe(), decode,
update vs bare forward + backward), ``--dry-run`` builds the real full-size configs on the meta device, and a family
that cannot import, runs out of memory or out of time is recorded as such without stopping the others."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def full_size():
    spec = importlib.util.spec_from_file_location("full_size", os.path.join(ROOT, "benchmarks", "full_size.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["full_size"] = module  # its dataclasses resolve their module by name
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("full_size", None)


@pytest.fixture(autouse=True)
def _quiet_scheduler_swap(monkeypatch):
    import trl_flow.models.wan as wan

    monkeypatch.setattr(wan, "_SCHEDULER_SWAP_WARNED", True)


def test_tiny_runs_every_available_family(full_size, tmp_path):
    out = tmp_path / "tiny.json"
    full_size.main(["--tiny", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data["meta"]["tiny"] is True
    families = data["families"]
    assert list(families) == list(full_size.SPECS)
    ran = 0
    for name, r in families.items():
        reason = full_size.availability(name)
        if reason is not None:
            assert r["status"] == "skipped" and r["reason"] == reason
            continue
        ran += 1
        assert r["status"] == "ok", (name, r.get("error"))
        K = r["steps_run"]
        assert K == full_size.TINY_SETTING["num_inference_steps"]
        ro, up = r["rollout"], r["update"]
        assert ro["samples"] == 2 and ro["chunk"] == 2
        for value in (ro["trl_s"], ro["pipe_s"], ro["ratio"], up["trl_s"], up["fwd_bwd_s"], up["ratio"],
                      r["decode"]["s"]):
            assert math.isfinite(value) and value > 0, (name, value)
        assert ro["trl_step_s"] == pytest.approx(ro["trl_s"] / K)
        assert up["trained_steps"] == K - 1  # flow_sde on every step but the last
        assert up["transformer_calls"] >= up["trained_steps"]  # (CFG families: two passes per step)
        assert up["baseline"] == "fwd+bwd" + (" + ref fwd" if r["setting"].get("beta") else "")
        assert r["rollout_mb_per_sample"] > 0 and r["peak_rss_mib"] > 0 and r["device"] == "cpu"
        assert set(r["embeddings"]) >= {"prompt_embeds"}
    assert ran >= 3  # SD3.5, FLUX.1 and Wan2.1 are always there
    for name in ("sd3.5-medium", "flux.1-dev", "wan2.1-t2v-1.3b"):
        assert families[name]["setting_source"].startswith("recipe trl_flow/recipes/")


# Published sizes of the transformers (billions of parameters): the configs in the script must build models of
# these sizes (Wan2.2-A14B: two 14B experts; SD3.5 Medium is announced as 2.5B with its embedders).
PUBLISHED_B = {"sd3.5-medium": 2.5, "flux.1-dev": 12.0, "wan2.1-t2v-1.3b": 1.3, "z-image": 6.0,
               "flux.2-klein-base-9b": 9.0, "qwen-image": 20.0, "flux.2-dev": 32.0, "wan2.2-t2v-a14b": 28.0}


def test_dry_run_builds_the_real_configs_on_the_meta_device(full_size):
    assert set(PUBLISHED_B) == set(full_size.SPECS)
    for name in full_size.SPECS:
        if full_size.availability(name) is not None:
            continue
        r = full_size.dry_run(name)
        assert r["transformer_params_b"] == pytest.approx(PUBLISHED_B[name], rel=0.12), name
        text = full_size.SPECS[name].text
        assert r["embeddings"]["prompt_embeds"] == [text["seq"] or r["setting"]["max_sequence_length"], text["width"]]
        assert r["rollout_mb_per_sample"] > 0
    flux = full_size.dry_run("flux.1-dev")  # 512 px, 6 steps: (16, 64, 64) latents; 7 states + 6 means in float32
    assert flux["latent_shape"] == [16, 64, 64] and flux["setting"]["per_device_train_batch_size"] == 3
    assert flux["rollout_mb_per_sample"] == pytest.approx((13 * 16 * 64 * 64 * 4 + 6 * 5 + 3 * 512 * 512 * 4) / 1e6,
                                                          abs=1e-3)


def test_unimportable_adapter_is_skipped_with_its_reason(full_size, monkeypatch, tmp_path):
    import trl_flow.models as models

    monkeypatch.setattr(models, "_ADAPTERS", {**models._ADAPTERS, "FluxPipeline": ".no_such_module:NoAdapter"})
    out = tmp_path / "r.json"
    full_size.main(["--tiny", "--families", "flux.1-dev", "sd3.5-medium", "--out", str(out)])
    families = json.loads(out.read_text())["families"]
    assert families["flux.1-dev"]["status"] == "skipped"
    assert "no_such_module" in families["flux.1-dev"]["reason"]
    assert "ModuleNotFoundError" in families["flux.1-dev"]["reason"]
    assert families["sd3.5-medium"]["status"] == "ok"  # the others still run


def test_out_of_memory_is_recorded_with_the_stage_and_earlier_results_kept(full_size, monkeypatch):
    from trl_flow import FlowGRPOTrainer

    def oom(self, rollout, step):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(FlowGRPOTrainer, "optimize", oom)
    r = full_size.measure("sd3.5-medium", tiny=True, steps=None, repeats=1, partial=None)
    assert r["status"] == "oom" and r["error"].startswith("update: CUDA out of memory")
    assert r["rollout"]["ratio"] > 0 and r["decode"]["s"] > 0 and "update" not in r


def test_a_family_over_its_budget_is_recorded_as_a_timeout(full_size, monkeypatch, tmp_path):
    monkeypatch.setattr(full_size.SPECS["sd3.5-medium"], "budget_s", 1)
    out = tmp_path / "r.json"
    full_size.main(["--tiny", "--isolate", "process", "--families", "sd3.5-medium", "--out", str(out)])
    r = json.loads(out.read_text())["families"]["sd3.5-medium"]
    assert r["status"] == "timeout" and "over its budget of 1 s" in r["error"] and r["budget_s"] == 1


def test_bad_arguments_fail_clearly(full_size, tmp_path):
    with pytest.raises(SystemExit, match=r"--families: unknown \['sdxl'\]"):
        full_size.main(["--tiny", "--families", "sdxl", "--out", str(tmp_path / "x.json")])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="needs a CUDA GPU.*--tiny"):
            full_size.main(["--families", "flux.1-dev", "--out", str(tmp_path / "x.json")])
