"""The shapes benchmark harness in --quick mode produces every output file with sane values."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(script: str = "shapes"):
    """A fresh copy of benchmarks/<script>.py (shapes.py's BASE / PILOT dicts are module state that --quick
    changes)."""
    name = "bench_shapes" if script == "shapes" else script
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "benchmarks", f"{script}.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_quick_harness_writes_every_output(tmp_path):
    mod = _load()
    mod.main(["--quick", "--tier", "0", "--out", str(tmp_path)])
    for name in ("results.json", "summary.json", "table.md", "score_vs_step.png", "score_vs_cpu.png",
                 "score_vs_kl.png"):
        assert os.path.getsize(tmp_path / name) > 100, name
    data = json.loads((tmp_path / "results.json").read_text())
    assert {r["method"] for r in data["runs"]} == {"flow_grpo", "op_grpo"}
    for run in data["runs"]:
        assert [e["step"] for e in run["evals"]] == [0, 2, 3]
        assert len(run["iterations"]) == 3
        for e in run["evals"]:
            for split in ("val", "test"):
                o = e[split]["overall"]
                assert 0 <= o["strict"] <= o["partial"] <= 1 and 0.5 < o["cleanliness"] <= 1 and o["n"] == 4
            assert math.isfinite(e["kl"]) and e["kl"] >= 0
        assert run["evals"][0]["kl"] < 1e-10  # before any update the policy is the base model
        assert run["evals"][-1]["kl"] > 0     # after updates it has moved
        for it in run["iterations"]:
            assert it["ratio_first_max_dev"] == 0.0
            assert it["time/rollout_s"] > 0 and it["time/update_s"] > 0 and it["cpu_s"] > 0
    op_iters = [r for r in data["runs"] if r["method"] == "op_grpo"][0]["iterations"]
    assert op_iters[-1]["buffer/size"] > 0 and any(i["off_policy_share"] > 0 for i in op_iters)
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["score_key"] == "partial" and saved["split"] == "val" and 0 < saved["base"] < 1
    assert saved["tier"] == 0 and saved["base_model"] == "clean"
    for m in ("flow_grpo", "op_grpo"):
        s = saved["methods"][m]
        assert s["seeds"] == [0] and 0 <= s["final_mean"] <= 1 and s["final_std"] == 0.0 and s["kl_final"] > 0
        assert "steps_to_target" in s and (saved["target"] is not None or s["steps_to_target"] is None)
    assert set(saved["acceptance"]) >= {"gain", "gain_ok", "gain_at_least_0.08", "gain_at_least_3_std",
                                        "cleanliness_ok"}
    table = (tmp_path / "table.md").read_text()
    assert "| flow_grpo |" in table and "| op_grpo |" in table


def test_run_config_layers_base_tier_pilot_method_and_learning_rate(tmp_path):
    mod = _load()
    # tier 2: the tier's rollout config over BASE (16 per group, no accumulation), the relation reward
    cfg, tr = mod.run_config("flow_dppo@3e-3", 1, 2, 5, str(tmp_path))
    assert tr.__name__ == "FlowDPPOTrainer" and mod.TIERS[2]["reward"] == "relation"
    assert (cfg.num_generations, cfg.gradient_accumulation_steps, cfg.num_inner_epochs) == (16, 1, 2)
    assert (cfg.learning_rate, cfg.seed, cfg.max_steps, cfg.clip_range) == (3e-3, 1, 5, mod.BASE["clip_range"])
    # tier 0 keeps BASE's 8 x 8 with accumulation; without @lr the swept rate or BASE's applies
    cfg0, _ = mod.run_config("flow_grpo", 0, 0, 5, str(tmp_path))
    assert (cfg0.num_generations, cfg0.gradient_accumulation_steps) == (8, 2)
    assert cfg0.learning_rate == mod.SWEPT_LR.get(0, {}).get("flow_grpo", mod.BASE["learning_rate"])
    # --set goes over the tier's config and under the method's own overrides
    mod.PILOT.update(num_generations=4, num_inner_epochs=3)
    cfg_p, _ = mod.run_config("flow_dppo", 0, 2, 5, str(tmp_path))
    assert cfg_p.num_generations == 4 and cfg_p.num_inner_epochs == 2
    mod.PILOT.clear()


def test_released_form_labels_follow_the_code_at_the_tiers_batch(tmp_path):
    """flow_dppo_unirl: UniRL's trained steps (3 random of steps 0-4), CFG 1, weight decay 0 and step-0 std, one
    pass, at the tier's G and prompts; flow_grpo_unirl_steps the same steps with the clip. op_grpo_g4_one: every
    group of 4 replays one buffered trajectory (25% of the samples), one per prompt in the buffer, late truncation."""
    mod = _load()
    dppo, tr = mod.run_config("flow_dppo_unirl", 0, 2, 5, str(tmp_path))
    grpo, tr_g = mod.run_config("flow_grpo_unirl_steps", 0, 2, 5, str(tmp_path))
    assert (tr.__name__, tr_g.__name__) == ("FlowDPPOTrainer", "FlowGRPOTrainer")
    for cfg in (dppo, grpo):
        assert (cfg.sde_steps_mode, cfg.sde_window_size, cfg.sde_window_range) == ("random", 3, 5)
        assert (cfg.guidance_scale, cfg.weight_decay, cfg.num_inner_epochs, cfg.beta) == (1.0, 0.0, 1, 0.0)
        assert (cfg.num_generations, cfg.prompts_per_step) == (16, 8)  # the tier's
        assert cfg.learning_rate == mod.BASE["learning_rate"]
    assert (dppo.kl_mask_first_step, dppo.trust_region, dppo.resolved_kl_mask_delta) == ("clamp", "kl_mask", 1e-5)
    assert (grpo.kl_mask_first_step, grpo.trust_region) == ("next_sigma", "clip")
    one, _ = mod.run_config("op_grpo_g4_one", 0, 2, 5, str(tmp_path))
    assert one.num_generations == 4 and one.replay_per_prompt == 1
    assert one.replay_sizes() == [1] * one.prompts_per_step  # 1 buffered + 3 fresh in every group
    assert sum(one.replay_sizes()) / (one.prompts_per_step * one.num_generations) == 0.25
    assert one.resolved_truncation_step == 8  # late: only the last trained step regenerated
    g4, _ = mod.run_config("op_grpo_g4", 0, 2, 5, str(tmp_path))
    assert g4.replay_sizes() == [2] * (g4.prompts_per_step // 2)  # the other reading: 2 + 2 in half the groups


def _fake_run(label, seed, scores, kls, cpu_per_iter=10.0):
    """A run record of the harness's schema: an evaluation every 10 iterations with the given primary scores."""
    def ev(i, sc, kl):
        o = {"strict": sc, "partial": sc, "cleanliness": 0.998, "n": 128}
        return {"step": 10 * i, "cpu_s": 10 * i * cpu_per_iter, "kl": kl,
                "trained": {"overall": o}, "val": {"overall": dict(o, strict=0.3)}}
    iters = [{"reward": 0.4 + 0.002 * k, "clip_frac": 0.05} for k in range(10 * (len(scores) - 1))]
    return {"method": label, "seed": seed, "tier": 2, "base_model": "noisy", "learning_rate": 1e-3,
            "evals": [ev(i, s, k) for i, (s, k) in enumerate(zip(scores, kls))], "iterations": iters,
            "cpu_s": cpu_per_iter * len(iters), "eval_cpu_s": 5.0}


def test_summary_of_a_sweep_folder_is_relative_to_its_one_flow_grpo_run():
    mod = _load()
    runs = [_fake_run("flow_grpo@0.001", s, [0.2, 0.3, 0.4, 0.5], [0, 0.1, 0.2, 0.3]) for s in (0, 1)]
    runs += [_fake_run("op_grpo@0.001", s, [0.2, 0.45, 0.5, 0.5], [0, 0.05, 0.1, 0.2], 12.0) for s in (0, 1)]
    s = mod.summarise(runs, 2)
    # target = base + 0.8 x Flow-GRPO's gain (0.3) = 0.44: Flow-GRPO reaches it at iteration 30, OP-GRPO at 10
    assert s["reference"] == "flow_grpo@0.001" and abs(s["target"] - 0.44) < 1e-12
    op, fg = s["methods"]["op_grpo@0.001"], s["methods"]["flow_grpo@0.001"]
    assert op["steps_to_target_per_seed"] == [10, 10] and fg["steps_to_target_per_seed"] == [30, 30]
    assert abs(op["steps_to_target"] - 1 / 3) < 1e-12 and abs(op["cpu_to_target"] - 120 / 300) < 1e-12
    assert op["kl_at_target"] == 0.05 and fg["kl_at_target"] == 0.3
    # the window mean averages each seed's last three evaluations: (0.3 + 0.4 + 0.5) / 3, (0.45 + 0.5 + 0.5) / 3
    assert abs(fg["last3_mean"][0] - 0.4) < 1e-12 and abs(op["last3_mean"][0] - 1.45 / 3) < 1e-12
    assert "KL at target" in mod.table(s) and "`flow_grpo@0.001`" in mod.table(s)
    # two Flow-GRPO rates and no swept one for the tier: no reference unless named; a wrong name is refused
    runs += [_fake_run("flow_grpo@0.002", 0, [0.2, 0.3, 0.3, 0.3], [0, 0.2, 0.3, 0.4])]
    assert mod.reference_label({r["method"] for r in runs}, 1) is None
    assert mod.reference_label({r["method"] for r in runs}, 2) == f"flow_grpo@{mod.SWEPT_LR[2]['flow_grpo']:g}"
    assert mod.summarise(runs, 2, "flow_grpo@0.001")["methods"]["op_grpo@0.001"]["steps_to_target"] == 1 / 3
    with pytest.raises(SystemExit, match="flow_grpo@0.005"):
        mod.summarise(runs, 2, "flow_grpo@0.005")


def test_summary_says_when_cpu_columns_mix_machines():
    mod = _load()
    m = mod.machine_info(reps=20)
    assert m["cpu"] and m["calibration_s"] > 0
    same = [dict(_fake_run("flow_grpo@0.001", s, [0.2, 0.5], [0, 0.3]), machine={"cpu": "x", "calibration_s": c})
            for s, c in ((0, 1.0), (1, 1.2))]
    s = mod.summarise(same, 2)
    assert s["cpu_comparable"] is True and [r["run"] for r in s["machines"]] == ["flow_grpo@0.001 seed 0",
                                                                                "flow_grpo@0.001 seed 1"]
    assert "mix machines" not in mod.table(s)
    slow = dict(_fake_run("op_grpo@0.001", 0, [0.2, 0.5], [0, 0.3]), machine={"cpu": "y", "calibration_s": 2.6})
    s = mod.summarise(same + [slow], 2)
    assert s["cpu_comparable"] is False and "calibration 1.00-2.60 s over 3 runs" in mod.table(s)
    s = mod.summarise(same + [_fake_run("op_grpo@0.001", 1, [0.2, 0.5], [0, 0.3])], 2)  # one run without a record
    assert s["cpu_comparable"] is False and "1 runs without a machine record" in mod.table(s)
    assert mod.summarise([_fake_run("flow_grpo@0.001", 0, [0.2, 0.5], [0, 0.3])], 2)["cpu_comparable"] is None


def test_a_run_record_carries_the_code_it_ran(tmp_path):
    """Every new run's record (run_record, what run_one returns) says what it ran: the checkout's git commit, whether
    tracked code differed from it, the evaluation seed and the machine; built here without training."""
    import platform
    import subprocess

    import torch

    mod = _load()
    config, _ = mod.run_config("flow_grpo@0.001", 1, 2, 10, str(tmp_path))
    evals = [{"step": 0, "cpu_s": 0.0, "eval_cpu_s": 2.0, "kl": 0.0}, {"step": 10, "cpu_s": 50.0, "eval_cpu_s": 3.0}]
    record = mod.run_record("flow_grpo@0.001", 1, 2, "noisy", config.to_dict(), [{"step": 1}], evals, 50.0)
    assert (record["method"], record["seed"], record["tier"]) == ("flow_grpo@0.001", 1, 2)
    assert record["learning_rate"] == 1e-3
    assert record["eval_cpu_s"] == 5.0 and record["config"]["learning_rate"] == "0.001"
    assert record["machine"]["calibration_s"] > 0
    code = record["code"]
    assert set(code) == {"git_commit", "dirty", "dirty_files", "eval_seed", "machine"}
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert code["git_commit"] == head.strip() and len(code["git_commit"]) == 40
    assert code["dirty"] is bool(code["dirty_files"])
    assert not any(f.startswith("benchmarks/results/") for f in code["dirty_files"])
    assert code["eval_seed"] == mod.EVAL_SEED == 1234
    assert code["machine"] == {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                               "python": platform.python_version(), "torch": torch.__version__}
    json.dumps(record)  # stored as JSON as it is


def test_restore_runs_writes_back_what_results_json_holds_and_keeps_what_is_there(tmp_path):
    mod = _load()
    runs = [_fake_run("flow_grpo@0.001", s, [0.2, 0.5], [0, 0.3]) for s in (0, 1)]
    (tmp_path / "results.json").write_text(json.dumps({"runs": runs}))
    (tmp_path / "runs").mkdir()
    kept = dict(runs[1], cpu_s=1.0)
    (tmp_path / "runs" / "flow_grpo@0.001_seed1.json").write_text(json.dumps(kept))
    written = mod.restore_runs(str(tmp_path))
    assert [os.path.basename(p) for p in written] == ["flow_grpo@0.001_seed0.json"]
    assert json.loads((tmp_path / "runs" / "flow_grpo@0.001_seed0.json").read_text()) == runs[0]
    assert json.loads((tmp_path / "runs" / "flow_grpo@0.001_seed1.json").read_text())["cpu_s"] == 1.0


def test_a_run_added_to_a_committed_folder_keeps_its_runs_and_a_foreign_task_is_refused_before_compute(tmp_path,
                                                                                                      monkeypatch):
    """``runs/`` is not committed: an invocation reads the folder's runs back from results.json and summarises all
    of them, so a new run joins the committed ones (it used to replace them); a run of another task is refused
    before its compute; --summarise-only alone rebuilds a fresh clone's folder."""
    mod = _load()
    task = mod._task(mod.TIERS[2])
    runs = [dict(_fake_run("flow_grpo@0.001", s, [0.2, 0.5], [0, 0.3]), task=task) for s in (0, 1)]
    (tmp_path / "results.json").write_text(json.dumps({"runs": runs}))
    mod.main(["--tier", "2", "--summarise-only", "--out", str(tmp_path)])
    assert sorted(os.listdir(tmp_path / "runs")) == ["flow_grpo@0.001_seed0.json", "flow_grpo@0.001_seed1.json"]
    assert [r["seed"] for r in json.loads((tmp_path / "results.json").read_text())["runs"]] == [0, 1]
    made = []

    def fake_run_one(label, seed, *a, **k):
        made.append((label, seed))
        return dict(_fake_run(label, seed, [0.2, 0.4], [0, 0.2]), task=task)
    monkeypatch.setattr(mod, "run_one", fake_run_one)
    (tmp_path / "runs" / "flow_grpo@0.001_seed1.json").unlink()  # restored again from results.json, not rerun
    summary = mod.main(["--tier", "2", "--methods", "flow_grpo", "--lrs", "1e-3", "--seeds", "1", "2",
                        "--out", str(tmp_path)])
    assert made == [("flow_grpo@0.001", 2)]
    assert summary["methods"]["flow_grpo@0.001"]["seeds"] == [0, 1, 2]
    assert [r["seed"] for r in json.loads((tmp_path / "results.json").read_text())["runs"]] == [0, 1, 2]
    with pytest.raises(SystemExit, match="different tasks"):
        mod.main(["--tier", "2", "--methods", "flow_grpo", "--lrs", "1e-3", "--seeds", "3", "--set", "reward=dense",
                  "--out", str(tmp_path)])
    assert made == [("flow_grpo@0.001", 2)]  # refused before any compute


def test_summary_reports_the_task_its_runs_were_made_with_and_refuses_a_mix():
    mod = _load()
    dense = dict(mod._task(mod.TIERS[1]), reward="dense")  # a `--set reward=dense` folder, summarised later
    runs = [dict(_fake_run("stepwise@0.001", s, [0.2, 0.5], [0, 0.3]), task=dense) for s in (0, 1)]
    s = mod.summarise(runs, 2)
    assert s["task"]["reward"] == "dense" and "`shapes_dense`" in mod.table(s)
    assert mod.summarise([_fake_run("flow_grpo@0.001", 0, [0.2, 0.5], [0, 0.3])], 2)["task"] == mod._task(mod.TIERS[2])
    other = dict(_fake_run("flow_grpo@0.001", 0, [0.2, 0.5], [0, 0.3]), task=mod._task(mod.TIERS[1]))
    with pytest.raises(SystemExit, match=r"different tasks.*'dense' reward: stepwise@0.001 seed 0, stepwise@0.001 "
                                         r"seed 1.*'relation' reward: flow_grpo@0.001 seed 0"):
        mod.summarise(runs + [other], 2)


def test_a_bare_label_at_a_swept_rate_is_summarised_with_its_rated_runs():
    mod = _load()
    rated = _fake_run("flow_grpo@0.001", 0, [0.2, 0.3, 0.4, 0.5], [0, 0.1, 0.2, 0.3])
    bare = _fake_run("flow_grpo", 1, [0.2, 0.3, 0.4, 0.3], [0, 0.1, 0.2, 0.3])  # --run-one flow_grpo: lr 1e-3
    other = dict(_fake_run("flow_grpo", 2, [0.2, 0.3], [0, 0.1]), learning_rate=5e-4)  # no rated runs at 5e-4
    runs = mod.canonical_labels([rated, bare, other])
    assert [r["method"] for r in runs] == ["flow_grpo@0.001", "flow_grpo@0.001", "flow_grpo"]
    assert bare["method"] == "flow_grpo"  # the record itself (results.json, its file's name) is left as it was
    s = mod.summarise(runs, 2)
    assert s["methods"]["flow_grpo@0.001"]["final_per_seed"] == [0.5, 0.3] and set(s["methods"]) == {
        "flow_grpo@0.001", "flow_grpo"}
    # a folder of bare labels only (the --methods layout) keeps its names
    assert [r["method"] for r in mod.canonical_labels([bare])] == ["flow_grpo"]
    # the same configuration and seed under both names is refused, not silently counted once or twice
    with pytest.raises(SystemExit, match="flow_grpo@0.001 seed 0"):
        mod.canonical_labels([rated, dict(bare, seed=0)])


def test_op_replay_advantages_diagnostic_measures_the_replayed_samples(tmp_path):
    mod = _load("op_replay_advantages")
    out = tmp_path / "ra.json"
    res = mod.main(["--steps", "2", "--out", str(out), "--workdir", str(tmp_path / "work")])
    assert json.loads(out.read_text())["rows"] == res["rows"]
    first, second = res["rows"]
    assert first["n_replayed"] == 0 and "replayed_adv" not in first  # the buffer is empty at the first iteration
    assert second["n_replayed"] == 8  # share 100 at G = 4: every one of the 8 groups replays one trajectory
    assert 0 <= second["replayed_is_group_best"] <= 1 and second["other_groups_reward"] is None
    # group-normalised advantages sum to 0 in each group: 8 replayed + 24 fresh samples
    assert 8 * second["replayed_adv"] + 24 * second["fresh_in_replayed_groups_adv"] == pytest.approx(0, abs=1e-4)
    assert res["means"]["replayed_adv"] == second["replayed_adv"]


def test_text_encoder_probe_pairs_relations_and_measures_their_embeddings():
    mod = _load("shapes_text_encoders")
    pairs = mod.relation_pairs()
    assert len(pairs) > 50
    for a, b in pairs:  # the two prompts differ in the relation only
        assert a != b and any(a.replace(x, y) == b for x, y in mod.OPPOSITE.items())
    res = mod.main(["--bases", "clean", "noisy"])
    assert res["bases"]["clean"] == res["bases"]["noisy"]  # the noisy base keeps the clean base's text encoders
    for key in ("token", "pooled"):
        m = res["bases"]["clean"][key]
        assert 0.05 < m["relative_difference"] < 1 and -1 < m["direction_cosine"] < 1
    # a pipeline whose text encoders ignore the words has no difference at all
    pipe = mod.model.load_base_pipeline(variant="clean")
    import torch

    with torch.no_grad():
        for te in (pipe.text_encoder, pipe.text_encoder_2):
            te.text_model.embeddings.token_embedding.weight.zero_()
    assert mod.measure(pipe, pairs[:4])["pooled"]["relative_difference"] == 0


def test_train_prompts_subset_trains_on_n_category_prompts_and_scores_them_beside_the_held_out_splits():
    mod = _load()
    pool = mod.train_prompts(mod.TIERS[3])
    t8, t32 = mod.subset_tier(mod.TIERS[3], 8), mod.subset_tier(mod.TIERS[3], 32)
    assert len(t32["train"]) == len(set(t32["train"])) == 32 and set(t32["train"]) <= set(pool)
    assert t32["train"][:8] == t8["train"]  # nested: a larger set adds prompts, keeps the smaller one's
    assert not set(t32["train"]) & set(mod._category_prompts("val", "position"))  # val stays held out
    assert list(t32["evals"]) == ["trained", "val", "test"] and t32["evals"]["trained"] == (t32["train"], 64)
    assert mod._task(t32)["train"] == t32["train"] != mod._task(mod.TIERS[3])["train"]  # summaries never mix them
    with pytest.raises(SystemExit, match="fixed prompt list"):
        mod.subset_tier(mod.TIERS[2], 4)
    with pytest.raises(SystemExit, match=f"has {len(pool)} training prompts"):
        mod.subset_tier(mod.TIERS[3], len(pool) + 1)


def test_summary_reports_the_colour_relation_over_the_runs_that_recorded_it():
    mod = _load()
    old = [_fake_run("flow_grpo@0.001", 0, [0.2, 0.5], [0, 0.3])]  # made before evaluate reported the relation
    new = []
    for seed, (a, b) in ((1, (0.6, 0.8)), (2, (0.6, 0.7))):
        r = _fake_run("flow_grpo@0.001", seed, [0.2, 0.5], [0, 0.3])
        for e, v in zip(r["evals"], (a, b)):
            e["val"]["overall"].update(relation=v, n_relation=70)
        new.append(r)
    s = mod.summarise(old + new, 2)
    rel = s["methods"]["flow_grpo@0.001"]["relation_by_split"]
    assert list(rel) == ["val"] and rel["val"]["seeds"] == [1, 2] and rel["val"]["base"] == pytest.approx(0.6)
    assert rel["val"]["final"][0] == pytest.approx(0.75) and rel["val"]["gain_per_seed"] == pytest.approx([0.2, 0.1])
    assert "flow_grpo@0.001 val 0.600 -> 0.750" in mod.table(s) and "(seeds 1, 2)" in mod.table(s)
    assert mod.summarise(old, 2)["methods"]["flow_grpo@0.001"]["relation_by_split"] == {}
    assert "Colour-level relation" not in mod.table(mod.summarise(old, 2))


def test_sparse_tier_prompts_follow_the_stated_rule_on_the_committed_base_table():
    import hashlib

    mod = _load()
    with open(os.path.join(ROOT, mod.SPARSE_BASE_TABLE)) as f:
        table = json.load(f)
    rows = table["per_prompt"]
    by = {r["prompt"]: r for r in rows}
    # the table covers the pool the rule walks (every RL-train position prompt), measured on tier 2's base with the
    # benchmark's evaluation sampler
    assert sorted(by) == sorted(mod.train_prompts(mod.TIERS[3])) and len(rows) == len(by) == 164
    assert table["base"] == mod.TIERS[2]["base"] == mod.TIERS[5]["base"]
    assert (table["ode"]["num_inference_steps"], table["ode"]["guidance_scale"], table["ode"]["seed"]) == (
        mod.BASE["eval_num_inference_steps"], mod.BASE["guidance_scale"], mod.EVAL_SEED)
    assert all(r["ode_strict"] == r["ode_successes"] / r["ode_n"] for r in rows)
    chosen = mod.SPARSE_PROMPTS
    assert len(chosen) == len(set(chosen)) == 8
    assert all(0 < by[p]["ode_strict"] <= mod.SPARSE_MAX_RATE == 0.15 for p in chosen)
    assert not set(chosen) & (set(mod.TIER2_PROMPTS) | set(mod.TIER2B_PROMPTS))
    md5 = lambda p: hashlib.md5(p.encode()).hexdigest()  # noqa: E731
    eligible = sorted((p for p, r in by.items() if 0 < r["ode_strict"] <= 0.15
                       and p not in mod.TIER2_PROMPTS and p not in mod.TIER2B_PROMPTS), key=md5)
    assert chosen == eligible[:8] == mod.sparse_prompts(rows)  # the first 8 of the order: none skipped
    # the rule's bounds bind: a chosen prompt measured at 0 (no success to replay) or above 0.15 is replaced by the
    # next eligible one in md5 order
    for rate in (0.0, 0.15625):
        changed = [dict(r, ode_strict=rate) if r["prompt"] == chosen[0] else r for r in rows]
        assert mod.sparse_prompts(changed) == chosen[1:] + [eligible[8]]
    with pytest.raises(ValueError, match=f"only {len(eligible)} prompts"):
        mod.sparse_prompts(rows, n=len(eligible) + 1)
    # the tier trains and scores those prompts on the binary reward, in its own folder, with its own gain rule
    tier = mod.TIERS[5]
    assert tier["train"] == chosen and tier["evals"]["trained"] == (chosen, 128)
    assert (tier["reward"], tier["score"], tier["primary"]) == ("strict", "strict", "trained")
    assert mod.default_out(5) == "benchmarks/results/shapes_sparse" and mod.default_out(2).endswith("shapes_tier2")
    runs = [_fake_run("flow_grpo@0.001", s, [0.1, 0.25], [0, 0.3]) for s in (0, 1, 2)]
    acc = mod.summarise(runs, 5)["acceptance"]
    assert acc["required_gain"] == mod.ACCEPT_GAIN_SPARSE == 0.10 and acc["gain_ok"]
    assert mod.summarise(runs, 2)["acceptance"]["required_gain"] == mod.ACCEPT_GAIN


def test_sparse_tier_numbers_in_the_docs_are_the_committed_ones():
    mod = _load()
    with open(os.path.join(ROOT, mod.SPARSE_BASE_TABLE)) as f:
        table = json.load(f)
    with open(os.path.join(ROOT, "docs", "benchmarks.md")) as f:
        text = " ".join(f.read().split())
    by = {r["prompt"]: r for r in table["per_prompt"]}
    for p in mod.SPARSE_PROMPTS:
        r = by[p]
        row = (f"| {p} | {r['ode_successes']} ({r['ode_strict']:.3f}) | "
               f"{r['rollout_successes']} ({r['rollout_strict']:.3f}) |")
        assert row in text, row
    assert f"ODE strict **{table['overall']['ode_strict']:.3f}**" in text
    assert f"rollout kernel **{table['overall']['rollout_strict']:.3f}**" in text
    with open(os.path.join(ROOT, "benchmarks", "results", "shapes_sparse_pilot", "results.json")) as f:
        (run,) = json.load(f)["runs"]
    curve = " -> ".join(f"{e['trained']['overall']['strict']:.3f}" for e in run["evals"])
    with open(os.path.join(ROOT, "docs", "history.md")) as f:  # the pilot: the lab notebook
        history = " ".join(f.read().split())
    assert f"**{curve}**" in history and run["tier"] == 5 and len(run["iterations"]) == 20
