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


@pytest.fixture(scope="module")
def tiny_json(full_size, tmp_path_factory):
    """One ``--tiny`` run of every family (CPU, seconds), shared by the tests that read its JSON."""
    import trl_flow.models.wan as wan

    old, wan._SCHEDULER_SWAP_WARNED = wan._SCHEDULER_SWAP_WARNED, True
    try:
        out = tmp_path_factory.mktemp("full_size") / "tiny.json"
        full_size.main(["--tiny", "--out", str(out)])
    finally:
        wan._SCHEDULER_SWAP_WARNED = old
    return out


def test_tiny_runs_every_available_family(full_size, tiny_json):
    data = json.loads(tiny_json.read_text())
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


def test_tiny_measures_baseline_and_fast_iterations(full_size, tiny_json):
    data = json.loads(tiny_json.read_text())
    assert data["meta"]["settings"] == full_size.SETTINGS and "iterations_note" in data["meta"]
    assert list(full_size.SPECS)[:2] == ["sd3.5-medium", "qwen-image"]  # the peers' families first
    K = full_size.TINY_SETTING["num_inference_steps"]
    for name, r in data["families"].items():
        if r["status"] == "skipped":
            continue
        its = r["iterations"]
        assert list(its) == ["baseline", "fast"], name
        base, fast = its["baseline"], its["fast"]
        for it in (base, fast):
            assert it["status"] == "ok", (name, it.get("error"))
            for key in ("rollout_images_per_s", "update_images_per_s", "iteration_images_per_s", "tflops"):
                assert math.isfinite(it[key]) and it[key] > 0, (name, key, it[key])
            assert it["samples"] == 2 and it["peak_gib"] is None  # CPU: no CUDA peak, no MFU (no known peak)
            assert "mfu" not in it
            assert it["iteration_images_per_s"] < min(it["rollout_images_per_s"], it["update_images_per_s"])
        assert base["config"] == {} and fast["config"] == full_size.SETTINGS["fast"]
        assert base["trained_steps"] == K - 1 and fast["trained_steps"] == 2  # the window of 2 of K
        assert fast["rows/update_transformer"] < base["rows/update_transformer"], name
        assert fast["calls/update_transformer"] < base["calls/update_transformer"], name  # one batched call
        assert fast["rows/rollout_transformer"] <= base["rows/rollout_transformer"], name  # shared ODE prefix


def test_table_of_a_tiny_json_says_not_run_on_a_gpu(full_size, tiny_json, tmp_path, capsys):
    table = full_size.main(["--table", str(tiny_json)])
    assert capsys.readouterr().out == table
    lines = table.splitlines()
    assert lines[0].startswith("Not run on a GPU yet") and lines[2] == full_size.TABLE_HEADER
    rows = [line for line in lines[4:] if line]
    families = json.loads(tiny_json.read_text())["families"]
    assert len(rows) == 2 * len(families)
    assert all(full_size.NOT_ON_GPU in row for row in rows)
    assert "| sd3.5-medium | baseline | 512 x 512 x 8 | - / 10 |" in rows[0]  # published, not tiny, sizes
    assert "| sd3.5-medium | fast |" in rows[1]
    wan = next(row for row in rows if row.startswith("| wan2.1-t2v-1.3b | baseline"))
    assert "| 240 x 416 x 33 x 8 |" in wan  # video: frames

    page = tmp_path / "performance.md"
    page.write_text(f"# Performance\n\nintro\n\n{full_size.TABLE_START}\nold table\n{full_size.TABLE_END}\n\nafter\n")
    full_size.main(["--table", str(tiny_json), "--page", str(page)])
    text = page.read_text()
    assert "old table" not in text and text.startswith("# Performance\n\nintro\n\n")
    assert text.endswith(f"{full_size.TABLE_END}\n\nafter\n")
    assert f"{full_size.TABLE_START}\n{table}{full_size.TABLE_END}" in text
    assert full_size.write_table(str(page), str(tiny_json)) == table and page.read_text() == text  # idempotent
    page.write_text("no markers\n")
    with pytest.raises(ValueError, match="needs the markers"):
        full_size.write_table(str(page), str(tiny_json))


def test_table_of_a_gpu_json_gives_images_per_s_memory_and_mfu(full_size, tiny_json, tmp_path):
    data = json.loads(tiny_json.read_text())
    data["meta"].update(tiny=False, gpu="NVIDIA H100 80GB HBM3")
    sd3 = data["families"]["sd3.5-medium"]
    for label, it in sd3["iterations"].items():
        it.update(peak_gib=30.25, mfu=0.3141, rollout_images_per_s=1.5, update_images_per_s=0.75,
                  iteration_images_per_s=0.5)
    sd3["iterations"]["fast"] = {"status": "oom", "error": "CUDA out of memory. Tried to allocate 2 GiB"}
    data["families"]["flux.1-dev"] = {"family": "flux.1-dev", "status": "timeout", "error": "update: over its budget"}
    table = full_size.render_table(data)
    assert table.startswith("NVIDIA H100 80GB HBM3, torch")
    rows = {tuple(c.strip() for c in line.split("|")[1:3]): line for line in table.splitlines()
            if line.startswith("| ") and "Family" not in line}
    base = rows[("sd3.5-medium", "baseline")]
    K = sd3["steps_run"]
    assert f"| {K} / {sd3['steps_published']} | 1.5 | 0.75 | 0.5 | 30.2 | 31.4% |" in base
    assert "| oom: CUDA out of memory" in rows[("sd3.5-medium", "fast")]
    assert "| timeout: update: over its budget |" in rows[("flux.1-dev", "baseline")]


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


def test_a_setting_out_of_memory_is_recorded_and_the_others_kept(full_size, monkeypatch):
    from trl_flow import FlowGRPOTrainer

    real = FlowGRPOTrainer.training_iteration

    def oom_when_fast(self, step):
        if self.config.batch_replay_steps:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")
        return real(self, step)

    monkeypatch.setattr(FlowGRPOTrainer, "training_iteration", oom_when_fast)
    r = full_size.measure("sd3.5-medium", tiny=True, steps=None, repeats=1, partial=None,
                          settings=("fast", "baseline"))
    assert r["status"] == "ok" and list(r["iterations"]) == ["fast", "baseline"]
    assert r["iterations"]["fast"]["status"] == "oom" and "9.00 GiB" in r["iterations"]["fast"]["error"]
    assert r["iterations"]["baseline"]["status"] == "ok" and r["iterations"]["baseline"]["trained_steps"] == 3
    none = full_size.measure("sd3.5-medium", tiny=True, steps=None, repeats=1, partial=None, settings=())
    assert none["status"] == "ok" and none["iterations"] == {}


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
