"""The results page: docs/results.md and its figures, rendered from committed benchmark results only.

    python benchmarks/results_page.py            # rewrite docs/results.md, docs/figures/*.png, README.md's table
    python benchmarks/results_page.py --check    # exit 1 if either page differs from what the results give

Every number on the page comes from a committed ``benchmarks/results/<folder>/results.json`` (each run's evaluation
curve) through :func:`claims`; tests/test_docs.py re-renders the page and compares it with the committed one. One
rule for every claimed difference: two methods are compared at the same samples and optimizer steps per iteration,
or the row says which side gets more and names the control. Every verdict, here and in the docs that quote one,
comes from :func:`significance` (Welch's test with Welch-Satterthwaite df; a gain over the base with the base's own
binomial error; two-sided p < 0.05; see its docstring and ``RULE``, the page's paragraph).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
PAGE = os.path.join(ROOT, "docs", "results.md")
FIGURES = os.path.join(ROOT, "docs", "figures")
# the last commit before benchmarks/shapes.py recorded each run's code: the runs that lack that record were committed
# by then, so the commits that committed them are the history up to it (a later commit never changes that list)
CODE_RECORDED_AFTER = "a0af8351e83ce22d98c1a519fddf49760cf73faa"

# OP-GRPO's described ablations (the replay-share change), each against the described form at lr 1e-3; Flow-GRPO last.
OP_ABLATIONS = {"op_grpo@0.001": "OP-GRPO (described form)",
                "op_grpo_per_step@0.001": "per-step ratio instead of the sequence weight",
                "op_grpo_no_correction@0.001": "no off-policy correction",
                "op_grpo_no_truncation@0.001": "no truncation (nothing regenerated)",
                "op_grpo_share_12@0.001": "12.5% of the samples replayed",
                "op_grpo_share_50@0.001": "50% of the samples replayed",
                "flow_grpo@0.001": "Flow-GRPO"}


def by_rate(*methods: tuple[str, str]) -> dict[str, str]:
    """Run label -> shown name for each (method, name) at each of the swept rates, rate by rate."""
    return {f"{m}@{lr}": f"{name}, lr {lr}" for lr in ("0.0005", "0.001", "0.002") for m, name in methods}


LAYOUT = {"flow_grpo_mixed@0.001": "Flow-GRPO, mixed", "flow_grpo@0.001": "Flow-GRPO, by prompt",
          "flow_dppo_1epoch_mixed@0.001": "Flow-DPPO, 1 epoch, mixed",
          "flow_dppo_1epoch@0.001": "Flow-DPPO, 1 epoch, by prompt",
          "diffusion_nft_cfg_mixed@0.001": "DiffusionNFT with CFG, mixed",
          "diffusion_nft_cfg@0.001": "DiffusionNFT with CFG, by prompt"}
UNIRL = {"flow_dppo_unirl@0.001": "Flow-DPPO, released code's form",
         "flow_grpo_unirl_steps@0.001": "Flow-GRPO, the same steps and CFG"}
G4_ONE = {"op_grpo_g4_one@0.0005": "OP-GRPO, one buffered trajectory per group, G = 4",
          "flow_grpo_g4@0.0005": "Flow-GRPO, G = 4"}


# Each panel: one committed results folder, the runs shown (label -> name on the page) and what they are.
PANELS = {
    # seeds 3-5 of Flow-GRPO and Flow-DPPO at 1 epoch (the README's first rows) in their own folder, by prompt as 0-2
    "tier2": dict(folder="shapes_tier2_matched", seeds_from=("shapes_tier2_seeds",),
                  title="Tier 2, prompt set A (8 position prompts, trained-prompt strict)",
                  methods={"flow_grpo@0.001": "Flow-GRPO", "flow_grpo_2epochs@0.001": "Flow-GRPO, 2 epochs",
                           "flow_dppo_1epoch@0.001": "Flow-DPPO, 1 epoch", "flow_dppo@0.001": "Flow-DPPO, 2 epochs",
                           "stepwise_t2@0.001": "Stepwise T'=2", "stepwise_t3@0.001": "Stepwise T'=3",
                           "stepwise@0.001": "Stepwise T'=5"}),
    "tier2b": dict(folder="shapes_tier2b", seeds_from=("shapes_tier2b_seeds",),
                   title="Tier 2, prompt set B (8 other position prompts, chosen by rule)",
                   methods={"flow_grpo@0.001": "Flow-GRPO", "flow_grpo_2epochs@0.001": "Flow-GRPO, 2 epochs",
                            "flow_dppo_1epoch@0.001": "Flow-DPPO, 1 epoch", "flow_dppo@0.001": "Flow-DPPO, 2 epochs",
                            "stepwise_t2@0.001": "Stepwise T'=2", "stepwise_t3@0.001": "Stepwise T'=3",
                            "stepwise@0.001": "Stepwise T'=5"}),
    "tier2op": dict(folder="shapes_tier2_op",
                    title="Tier 2, prompt set A: OP-GRPO in its described form against Flow-GRPO, three learning "
                          "rates",
                    methods=by_rate(("flow_grpo", "Flow-GRPO"), ("op_grpo", "OP-GRPO"))),
    "sparse": dict(folder="shapes_sparse",
                   title="Tier 5, the sparse tier (binary reward, base success about 0.1): OP-GRPO against Flow-GRPO, "
                         "three learning rates",
                   methods=by_rate(("flow_grpo", "Flow-GRPO"), ("op_grpo", "OP-GRPO"))),
    "tier2op_ablations": dict(folder="shapes_tier2_op",
                              title="Tier 2, prompt set A: OP-GRPO's described ablations, lr 1e-3",
                              methods=OP_ABLATIONS),
    "sparse_ablations": dict(folder="shapes_sparse",
                             title="Tier 5, the sparse tier: OP-GRPO's described ablations, lr 1e-3",
                             methods=OP_ABLATIONS),
    # DiffusionNFT as its paper compares it: sampled without CFG (from that base, 0.117) against Flow-GRPO sampled
    # with CFG (from 0.242), to Flow-GRPO's target on set A, an absolute score (the paper's: a GenEval score).
    "nft": dict(folder="shapes_tier2_nft",
                title="Tier 2, prompt set A: DiffusionNFT sampled without CFG (dotted: its base, the same model "
                      "without CFG) against Flow-GRPO sampled with CFG (its base 0.242), three learning rates",
                methods={**by_rate(("diffusion_nft", "DiffusionNFT without CFG")),
                         **by_rate(("flow_grpo", "Flow-GRPO with CFG"))},
                extra="shapes_tier2_op", target_from="shapes_tier2_op"),
    "nft_cfg": dict(folder="shapes_tier2_op",
                    title="Tier 2, prompt set A: DiffusionNFT and Flow-GRPO, both sampled with CFG 3, three learning "
                          "rates",
                    methods=by_rate(("flow_grpo", "Flow-GRPO"), ("diffusion_nft_cfg", "DiffusionNFT with CFG"))),
    "nft_cfg_b": dict(folder="shapes_tier2b_nft", extra="shapes_tier2b", target_from="shapes_tier2b",
                      seeds_from=("shapes_tier2b_seeds",),
                      title="Tier 2, prompt set B: DiffusionNFT and Flow-GRPO, both sampled with CFG 3, lr 1e-3",
                      methods={"flow_grpo@0.001": "Flow-GRPO, lr 0.001",
                               "diffusion_nft_cfg@0.001": "DiffusionNFT with CFG, lr 0.001"}),
    # CPU to the target on set A, all on one machine: Flow-GRPO's lr-5e-4 runs made again beside DiffusionNFT's (the
    # one rate where every seed of all three reached the target; the scores repeat shapes_tier2_op's exactly, tested),
    # the target shapes_tier2_op's.
    "nft_cpu": dict(folder="shapes_tier2_cpu_ref",
                    title="Tier 2, prompt set A, one machine: DiffusionNFT with and without CFG against Flow-GRPO "
                          "with CFG, lr 5e-4",
                    methods={"flow_grpo@0.0005": "Flow-GRPO with CFG, lr 0.0005",
                             "diffusion_nft_cfg@0.0005": "DiffusionNFT with CFG, lr 0.0005",
                             "diffusion_nft@0.0005": "DiffusionNFT without CFG, lr 0.0005"},
                    extra=("shapes_tier2_op", "shapes_tier2_nft"), target_from="shapes_tier2_op"),
    # Tier 3 (noisy base, the tier's default): trained on the category's prompts, scored on held-out val prompts.
    "nft_t3": dict(folder="shapes_tier3_nft",
                   title="Tier 3, noisy base (164 position prompts, held-out val strict): DiffusionNFT sampled "
                         "without CFG (dotted: its base) against Flow-GRPO sampled with CFG (its base 0.280)",
                   methods={**by_rate(("diffusion_nft", "DiffusionNFT without CFG")),
                            "flow_grpo@0.001": "Flow-GRPO with CFG, lr 0.001"},
                   extra="shapes_tier3", target_from="shapes_tier3"),
    "nft_t3_cfg": dict(folder="shapes_tier3",
                       title="Tier 3, noisy base (164 position prompts, held-out val strict): DiffusionNFT and "
                             "Flow-GRPO, both sampled with CFG 3",
                       methods={"flow_grpo@0.001": "Flow-GRPO, lr 0.001",
                                "diffusion_nft_cfg@0.0005": "DiffusionNFT with CFG, lr 0.0005",
                                "diffusion_nft_cfg@0.001": "DiffusionNFT with CFG, lr 0.001",
                                "diffusion_nft_cfg@0.002": "DiffusionNFT with CFG, lr 0.002"}),
    # Tier 6 at two rates, 120 iterations each; the target is shapes_edit_long's (base + 0.8 x lr 1e-3's gain).
    "edit": dict(folder="shapes_edit_lr5e4",
                 title="Tier 6, editing (a tiny FLUX.1 Kontext pipeline, 8 instructions, 60 source scenes each, "
                       "binary edit-success reward): Flow-GRPO with KL weight 0.04, 120 iterations, two rates",
                 methods={"flow_grpo@0.0005": "Flow-GRPO, lr 0.0005, beta 0.04",
                          "flow_grpo@0.001": "Flow-GRPO, lr 0.001, beta 0.04"},
                 extra="shapes_edit_long", target_from="shapes_edit_long"),
    "tier3": dict(folder="shapes_tier3_sharp", title="Tier 3, sharp base (164 position prompts, held-out val strict)",
                  methods={"flow_grpo@0.0005": "Flow-GRPO", "flow_dppo@0.0005": "Flow-DPPO, 2 epochs"}),
    # Update batches: mixed prompts in every microbatch (batch_layout="mixed", the default since the fidelity review:
    # the released code shuffles) against prompt by prompt (the runs of the panels above), lr 1e-3, same target.
    "layout": dict(folder="shapes_tier2_mixed",
                   title="Tier 2, prompt set A: mixed-prompt update batches (the released code's) against prompt by "
                         "prompt",
                   methods=LAYOUT,
                   extra=("shapes_tier2_matched", "shapes_tier2_op"), target_from="shapes_tier2_matched",
                   seeds_from=("shapes_tier2_seeds",)),
    "layout_b": dict(folder="shapes_tier2b_mixed",
                     title="Tier 2, prompt set B: mixed-prompt update batches against prompt by prompt",
                     methods=LAYOUT,
                     extra=("shapes_tier2b", "shapes_tier2b_nft"), target_from="shapes_tier2b",
                     seeds_from=("shapes_tier2b_seeds",)),
    # Flow-DPPO as UniRL's recipe trains (3 random SDE steps among the first 5 of 10, CFG 1, weight decay 0, its
    # step-0 std) against Flow-GRPO on the same steps and CFG; evaluated at CFG 1, so their base is the model at CFG 1.
    "unirl": dict(folder="shapes_tier2_unirl",
                  title="Tier 2, prompt set A: Flow-DPPO in its released code's form against Flow-GRPO on the same "
                        "trained steps and CFG 1 (dotted: the base at CFG 1)", methods=UNIRL),
    "unirl_b": dict(folder="shapes_tier2b_unirl",
                    title="Tier 2, prompt set B: Flow-DPPO in its released code's form against Flow-GRPO on the same "
                          "trained steps and CFG 1 (dotted: the base at CFG 1)", methods=UNIRL),
    # OP-GRPO where both of its descriptions hold (G = 4: G - 1 fresh + 1 buffered in every group, 25% of the
    # samples), against Flow-GRPO at G = 4 (32 samples an iteration), lr 5e-4.
    "g4_one": dict(folder="shapes_tier2_g4",
                   title="Tier 2, prompt set A, G = 4: OP-GRPO with one buffered trajectory in every group against "
                         "Flow-GRPO", methods=G4_ONE),
    # Flow-GRPO-Fast's settings (benchmarks/shapes.py FAST: window 2, shared prefix, batched replay, trained-steps
    # storage, cached embeddings) against Flow-GRPO training every step, both with mixed-prompt batches, lr 1e-3.
    "fast": dict(folder="shapes_tier2_fast",
                 title="Tier 2, prompt set A: Flow-GRPO-Fast's settings (2 trained steps of 10) against Flow-GRPO "
                       "(9 trained steps), the same samples per iteration",
                 methods={"flow_grpo_fast_mixed@0.001": "Flow-GRPO-Fast settings",
                          "flow_grpo_mixed@0.001": "Flow-GRPO"},
                 extra="shapes_tier2_mixed", target_from="shapes_tier2_mixed"),
    "g4_one_sparse": dict(folder="shapes_sparse_g4",
                          title="Tier 5, the sparse tier, G = 4: OP-GRPO with one buffered trajectory in every group "
                                "against Flow-GRPO", methods=G4_ONE),
}


# ------------------------------------------------------------------------------------------------- statistics
ALPHA = 0.05  # two-sided level of every verdict
POWER = 0.8  # the power at which a row's smallest detectable difference is stated

RULE = ("One rule for every difference, from one function (`results_page.significance`): two methods are compared at "
        "the same samples and optimizer steps per iteration, or the row says which side gets more. Two methods: "
        "Welch's t over seeds, with Welch-Satterthwaite degrees of freedom. A method against the base: the seeds' "
        "mean against the base score, whose own sampling error (one evaluation of n images: binomial standard error "
        "sqrt(p (1 - p) / n)) is a second variance term: Welch's test of the seeds against the base's n images, "
        "Welch-Satterthwaite df with n - 1 for the base's term (the seeds' n - 1 when the base's error is small, more"
        " as it dominates; so p can fall below that of taking the base as exact). A base whose image count is not "
        "recorded is taken as exact: a one-sample t at the seeds' n - 1 df. Each cell gives t, df and the two-sided p"
        " (scipy.stats); the verdict is *holds* (or *the opposite*) at p < 0.05 and *within the noise* otherwise, and"
        " *no spread* where every seed of both sides gave the same value (no test is defined). Each row also gives "
        "the smallest difference its seeds could detect: the true difference at which the same test reaches p < 0.05 "
        "with 80% power, from the noncentral t distribution at the observed standard error and df (normal where df is"
        " infinite), in the units of the compared value. A speed row where a seed never reached the target is not "
        "tested; its detectable difference (marked +) counts such a seed at its run's end, a lower bound on its "
        "value. A claim not yet measured in the paper's form says so.")


def ms(xs) -> tuple[float, float] | None:
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    return statistics.mean(xs), (statistics.stdev(xs) if len(xs) > 1 else None)  # None: one seed, no spread


def binomial_se(p: float, n: int | None) -> float:
    """The standard error of an accuracy ``p`` measured on ``n`` images, sqrt(p (1 - p) / n); 0 without ``n``."""
    return math.sqrt(p * (1 - p) / n) if n else 0.0


def detectable(se: float, df: float, alpha: float = ALPHA, power: float = POWER) -> float:
    """The smallest true difference a two-sided test at ``alpha`` with standard error ``se`` and ``df`` degrees of
    freedom detects with probability ``power``: delta with P(|T| > t_crit) = power, T noncentral t (df, delta / se);
    the normal approximation (z_crit + z_power) * se where df is infinite."""
    from scipy import optimize, stats

    if math.isinf(df):
        return (stats.norm.ppf(1 - alpha / 2) + stats.norm.ppf(power)) * se
    crit = stats.t.ppf(1 - alpha / 2, df)

    def short(nc):
        wrong_side = stats.nct.cdf(-crit, df, nc)  # tiny; scipy gives NaN for some large nc
        return stats.nct.sf(crit, df, nc) + (0.0 if math.isnan(wrong_side) else wrong_side) - power

    hi = crit  # power there is about one half; double until it passes ``power``
    while short(hi) < 0:
        hi *= 2
    return optimize.brentq(short, 0.0, hi) * se


def significance(a, b=None, *, base: float | None = None, base_se: float = 0.0, base_n: int | None = None,
                 better: str | None = None) -> dict:
    """The one test behind every verdict on the results page and in the docs that quote one.

    * ``b`` given: Welch's t of mean(a) - mean(b), se^2 = s_a^2 / n_a + s_b^2 / n_b, Welch-Satterthwaite df
      se^4 / ((s_a^2 / n_a)^2 / (n_a - 1) + (s_b^2 / n_b)^2 / (n_b - 1)).
    * ``base`` given: mean(a) - base, se^2 = s_a^2 / n_a + base_se^2 (``base_se``: the base score's own sampling
      error, :func:`binomial_se` of its ``base_n`` images): Welch's test of the seeds against the base's images,
      Welch-Satterthwaite df se^4 / ((s_a^2 / n_a)^2 / (n_a - 1) + base_se^4 / (base_n - 1)) (the base's term at
      infinite df without ``base_n``). With ``base_se`` 0 this is the one-sample t at n_a - 1 df. The base's term
      adds variance but also df (its variance is known from many images), so p may fall below the p that takes
      the base as exact where the seeds' spread was the larger uncertainty.
    * neither: mean(a) against 0 (a one-sample t at n_a - 1 df).

    p is two-sided (scipy.stats.t, or the normal at infinite df). ``word``: "holds" at p < ``ALPHA`` in the
    direction ``better`` ("higher": a above b or the base; "lower"), "the opposite" at p < ``ALPHA`` the other way
    (without ``better``: "differs"), else "within the noise"; "no spread" where the standard error is 0 (every seed
    of every side the same value: no test is defined, nothing is divided by it); "too few seeds" with fewer than 2
    values on a side. ``mdd``: :func:`detectable` at this test's se and df. Returns {"diff", "se", "t", "df", "p",
    "mdd", "word", "na", "nb"}."""
    from scipy import stats

    xa = [float(x) for x in a if x is not None]
    xb = None if b is None else [float(x) for x in b if x is not None]
    out = {"diff": None, "se": None, "t": None, "df": None, "p": None, "mdd": None, "na": len(xa),
           "nb": None if xb is None else len(xb)}
    if len(xa) < 2 or (xb is not None and len(xb) < 2):
        return {**out, "word": "too few seeds"}
    terms = [(statistics.variance(xa) / len(xa), len(xa) - 1)]  # (variance of the mean, its df)
    if xb is not None:
        terms.append((statistics.variance(xb) / len(xb), len(xb) - 1))
        ref = statistics.mean(xb)
    else:
        ref = 0.0 if base is None else base
        if base is not None and base_se:
            terms.append((base_se ** 2, base_n - 1 if base_n else math.inf))
    diff = statistics.mean(xa) - ref
    var = sum(v for v, _ in terms)
    out["diff"] = diff
    if var == 0:
        return {**out, "se": 0.0, "word": "no spread"}
    finite = sum(v * v / d for v, d in terms if not math.isinf(d))
    df = var * var / finite if finite else math.inf
    se = math.sqrt(var)
    t = diff / se
    p = float(2 * (stats.norm.sf(abs(t)) if math.isinf(df) else stats.t.sf(abs(t), df)))
    if p >= ALPHA:
        word = "within the noise"
    elif better is None:
        word = "differs"
    else:
        word = "holds" if (t > 0) == (better == "higher") else "the opposite"
    return {**out, "se": se, "t": t, "df": df, "p": p, "mdd": float(detectable(se, df)), "word": word}


def stat_text(r: dict) -> str:
    """``t +3.2, df 2.0, p 0.085`` (or why there is no test) for a :func:`significance` result."""
    if r["t"] is None:
        return r["word"]
    df = "inf" if math.isinf(r["df"]) else f"{r['df']:.1f}"
    p = "p < 0.001" if r["p"] < 0.001 else f"p {r['p']:.3f}"
    return f"t {r['t']:+.1f}, df {df}, {p}"


def welch_t(a, b) -> float | None:
    """Welch's t of mean(a) - mean(b) (:func:`significance`'s); None with fewer than 2 values a side or no spread."""
    return significance(a, b)["t"]


def one_sample_t(xs, base: float, base_se: float = 0.0, base_n: int | None = None) -> float | None:
    """t of mean(xs) against ``base`` (with its standard error ``base_se`` from ``base_n`` images:
    :func:`significance`'s); None with fewer than 2 values or no spread."""
    return significance(xs, base=base, base_se=base_se, base_n=base_n)["t"]


def extra_folders(panel: dict) -> tuple[str, ...]:
    """A panel's ``extra``: one folder name or several, as a tuple."""
    extras = panel.get("extra", ())
    return (extras,) if isinstance(extras, str) else tuple(extras)


def load_panel(name: str) -> dict | None:
    """Per shown label, per-seed values from the folder's results.json (None when the folder is not committed)."""
    panel = PANELS[name]
    path = os.path.join(RESULTS, panel["folder"], "results.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        data = json.load(f)
    summary = data["summary"]
    split, key, target = summary["split"], summary["score_key"], summary["target"]
    runs_of = {label: [r for r in data["runs"] if r["method"] == label] for label in panel["methods"]}
    from_folder = {label: panel["folder"] for label in panel["methods"] if runs_of[label]}
    extras = extra_folders(panel)
    for side in dict.fromkeys([*extras, panel.get("target_from")]):
        # other folders of the same tier and prompts: their runs of labels this folder lacks (the first folder that
        # has a label gives all its runs), and / or the target
        if side is None:
            continue
        with open(os.path.join(RESULTS, side, "results.json")) as f:
            other = json.load(f)
        if (other["summary"]["split"], other["summary"]["score_key"]) != (split, key):
            raise ValueError(f"panel {name!r}: {side} scores {other['summary']['split']} / "
                             f"{other['summary']['score_key']}, {panel['folder']} {split} / {key}")
        if side == panel.get("target_from"):
            target = other["summary"]["target"]
        if side in extras:
            for label in panel["methods"]:
                if not runs_of[label]:
                    runs_of[label] = [r for r in other["runs"] if r["method"] == label]
                    from_folder.update({label: side} if runs_of[label] else {})
    for side in panel.get("seeds_from", ()):
        # later runs of the same labels, tier and prompts: the seeds the panel's runs lack (its target stays its own)
        with open(os.path.join(RESULTS, side, "results.json")) as f:
            other = json.load(f)
        if (other.get("tier"), other["summary"]["split"], other["summary"]["score_key"]) != (data.get("tier"), split,
                                                                                              key):
            raise ValueError(f"panel {name!r}: seeds_from {side} is tier {other.get('tier')} scoring "
                             f"{other['summary']['split']} / {other['summary']['score_key']}, {panel['folder']} "
                             f"tier {data.get('tier')} {split} / {key}")
        for label in panel["methods"]:
            have = {r["seed"] for r in runs_of[label]}
            runs_of[label] += [r for r in other["runs"] if r["method"] == label and r["seed"] not in have]
    # the base is one evaluation (each run's step 0, the same images): its image count gives its binomial error
    counts = {r["evals"][0][split]["overall"].get("n") for r in data["runs"]
              if r["evals"] and r["evals"][0]["step"] == 0 and abs(r["evals"][0][split]["overall"][key]
                                                                    - summary["base"]) < 1e-9}
    base_n = counts.pop() if len(counts) == 1 else None  # None: not recorded (or ambiguous): the base taken as exact
    out = {"base": summary["base"], "base_n": base_n, "base_se": binomial_se(summary["base"], base_n),
           # older summaries: none
           "base_by_split": {sp: b[key] for sp, b in summary.get("base_by_split", {}).items()},
           "target": target, "split": split, "score": key, "methods": {},
           # the folders whose shown runs do not record the code they ran (runs made before they did)
           "without_code": sorted({from_folder[label] for label, runs in runs_of.items()
                                   if any("code" not in r for r in runs)})}
    for label in panel["methods"]:
        runs = sorted(runs_of[label], key=lambda r: r["seed"])
        if not runs:
            continue

        def reach(r, field):
            return next((e[field] for e in r["evals"] if target is not None
                         and e[split]["overall"][key] >= target - 1e-9), None)

        def crossing(r):
            """The iteration at which the run's score crosses the target, linear between the two evaluations that
            bracket it (evaluations are every 10 iterations or so); None where it never does."""
            evals = r["evals"]
            for i, e in enumerate(evals):
                y = e[split]["overall"][key]
                if target is None or y < target - 1e-9:
                    continue
                if i == 0:
                    return float(e["step"])
                s0, y0 = evals[i - 1]["step"], evals[i - 1][split]["overall"][key]
                return s0 + (e["step"] - s0) * (target - y0) / (y - y0)
            return None

        out["methods"][label] = {
            "seeds": [r["seed"] for r in runs],
            "final": [r["evals"][-1][split]["overall"][key] for r in runs],
            "final_by_split": {sp: [r["evals"][-1][sp]["overall"][key] for r in runs]
                               for sp in runs[0]["evals"][-1] if isinstance(runs[0]["evals"][-1][sp], dict)},
            "kl": [r["evals"][-1]["kl"] for r in runs],
            "steps_to_target": [crossing(r) for r in runs],  # interpolated between evaluations
            "steps_to_target_raw": [reach(r, "step") for r in runs],  # the first evaluation reaching it
            "cpu_to_target": [reach(r, "cpu_s") for r in runs],
            "kl_at_target": [reach(r, "kl") for r in runs],
            "cpu_per_iter": [r["cpu_s"] / len(r["iterations"]) for r in runs],
            # where a run stopped: a never-reached target lies beyond it (:func:`censored_detectable`)
            "run_end": {"steps_to_target": [float(len(r["iterations"])) for r in runs],
                        "cpu_to_target": [r["cpu_s"] for r in runs]},
            "clip_off": [off_policy_clip(r) for r in runs],
            "calibration": [r.get("machine", {}).get("calibration_s") for r in runs],
            "curves": [[(e["step"], e["cpu_s"], e["kl"], e[split]["overall"][key]) for e in r["evals"]] for r in runs],
        }
    return out


def off_policy_clip(run: dict) -> float | None:
    """A run's off-policy clip fraction: the share of replayed steps whose ratio left the clip range
    (``clip_frac_off_policy``), mean over the iterations that replayed; None for a run that never replays."""
    xs = [x for x in (i.get("clip_frac_off_policy") for i in run["iterations"]) if x is not None and not math.isnan(x)]
    return statistics.mean(xs) if xs else None


def fmt(pair, nd=3, percent=False) -> str:
    """``mean +- std`` (or ``mean (1 seed)``); ``percent``: a fraction printed as a percentage with one decimal."""
    if pair is None:
        return "n/a"
    if percent:
        m, sd = (None if x is None else 100 * x for x in pair)
        return f"{m:.1f}% (1 seed)" if sd is None else f"{m:.1f}% +- {sd:.1f}%"
    return f"{pair[0]:.{nd}f} (1 seed)" if pair[1] is None else f"{pair[0]:.{nd}f} +- {pair[1]:.{nd}f}"


def compare(p: dict, a: str, b: str, field: str = "final", better: str | None = None) -> dict | None:
    """a against b on one per-seed field: means, ratio of means and :func:`significance`'s test (``test``; its t
    also as ``t``)."""
    ma, mb = p["methods"].get(a), p["methods"].get(b)
    if not ma or not mb:
        return None
    xa, xb = [x for x in ma[field] if x is not None], [x for x in mb[field] if x is not None]
    if not xa or not xb:
        return None
    test = significance(xa, xb, better=better)
    return {"a": ms(xa), "b": ms(xb), "na": len(xa), "nb": len(xb), "t": test["t"], "test": test,
            "ratio": statistics.mean(xa) / statistics.mean(xb) if statistics.mean(xb) else None}


def gain(p: dict, a: str, field: str = "final", better: str | None = "higher") -> dict:
    """:func:`significance` of a run's per-seed values against the panel's base, with the base's binomial error."""
    return significance(p["methods"][a][field], base=p["base"], base_se=p.get("base_se", 0.0),
                        base_n=p.get("base_n"), better=better)


# ------------------------------------------------------------------------------------------------- quoted tables
ABLATION_ROWS = {"op_grpo@0.001": "described form (sequence weight)", "op_grpo_per_step@0.001": "per-step ratio",
                 "op_grpo_no_correction@0.001": "no correction", "op_grpo_no_truncation@0.001": "no truncation",
                 "op_grpo_share_12@0.001": "12.5% replayed", "op_grpo_share_50@0.001": "50% replayed"}


def folders_note(panel: dict) -> str:
    """Where a panel's runs and target come from: its folder, and the folders that add runs or give the target."""
    extras = [e for e in extra_folders(panel) if e != panel["folder"]]
    text = f"folder `benchmarks/results/{panel['folder']}/`"
    if extras:
        text += " and the runs it lacks from " + ", ".join(f"`benchmarks/results/{e}/`" for e in extras)
    if panel.get("target_from") not in (None, panel["folder"]):
        text += f"; target from `benchmarks/results/{panel['target_from']}/`"
    if panel.get("seeds_from"):
        text += "; further seeds from " + ", ".join(f"`benchmarks/results/{e}/`" for e in panel["seeds_from"])
    return text


def reached_cell(p: dict, m: dict, field: str = "steps_to_target_raw", nd: int = 0) -> str:
    """Iterations to the panel's target (``field``: the first evaluation reaching it, or ``steps_to_target``,
    interpolated): mean +- std over the seeds that reached it (n of seeds)."""
    steps = [s for s in m[field] if s is not None]
    if steps:  # one value has no spread: the count says it is one seed's
        one = f"{steps[0]:.{nd}f}" if nd else f"{steps[0]:g}"
        return f"{one if len(steps) == 1 else fmt(ms(steps), nd)} ({len(steps)} of {len(m['seeds'])})"
    return "not reached" if p["target"] is not None else "no target on this panel"


def committed_in(folder: str) -> list[str]:
    """The commits (short hashes, newest first) that changed ``folder``'s results.json up to ``CODE_RECORDED_AFTER``
    (runs made later record their own code); [] without git."""
    import subprocess

    try:
        out = subprocess.run(["git", "log", "--format=%h", "--abbrev=10", CODE_RECORDED_AFTER, "--",
                              os.path.join("benchmarks", "results", folder, "results.json")],
                             cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return []
    return out.split()


# Older batches whose first iterations do not repeat bit for bit here (tests/test_committed_runs_reproduce.py runs
# one run of every other older batch and finds it repeats exactly; its docstring has the measured differences).
NOT_REPRODUCED = {
    "shapes_tier3_sharp": "does not repeat here: made on an Intel Xeon, on an AMD EPYC the first rollout repeats but "
                          "the loss differs in the 6th digit, as the harness at the batch's own commit gives it here "
                          "(the CPU, not the code); not yet re-run on an Intel Xeon",
    "shapes_tier2_matched": "its Stepwise T'=5 runs do not repeat here: the first rollout does, the loss differs in "
                            "the 4th digit, as the harness at the commits that committed them gives it here (another "
                            "machine, not the code)",
}


def committed_note(p: dict) -> str:
    """For each folder of a panel whose runs do not record the code they ran, the commits that committed its results
    (when a run was made is not recorded, only when its results were committed), and whether one of its runs repeats
    its first iterations here (:data:`NOT_REPRODUCED`)."""
    parts = []
    for folder in p.get("without_code", []):
        commits = committed_in(folder)
        parts.append(f"`benchmarks/results/{folder}/` committed in "
                     + (", ".join(commits) if commits else "(no git history here)")
                     + (f" ({NOT_REPRODUCED[folder]})" if folder in NOT_REPRODUCED else ""))
    return (" Runs without a record of the code they ran: " + "; ".join(parts) + "; one run of each batch not said "
            "otherwise repeats its first iterations bit for bit (tests/test_committed_runs_reproduce.py).") \
        if parts else ""


def nft_tier3_table(cfg: dict, free: dict) -> list[str]:
    """docs/diffusion_nft.md's tier-3 table from the ``nft_t3_cfg`` and ``nft_t3`` panels: Flow-GRPO with CFG (tier
    3's one committed rate) and DiffusionNFT with and without CFG at each committed rate: final strict on the held-out
    val and test splits, KL to the base, iterations to the tier's target (an absolute val score; the first evaluation
    reaching it), Welch's test (:func:`significance`: t, df, p) of the final val score against Flow-GRPO; mean +- std
    over seeds (tests/test_docs.py checks the page against this)."""
    ref = cfg["methods"]["flow_grpo@0.001"]
    rows = ["| run | lr | seeds | base val / test | final val strict | final test strict | KL to the base | "
            f"iterations to {cfg['target']:.3f} | t vs Flow-GRPO, val |", "|---|---|---|---|---|---|---|---|---|"]
    rates = ("0.0005", "0.001", "0.002")
    for p, name, labels in ((cfg, "Flow-GRPO with CFG", ["flow_grpo@0.001"]),
                            (cfg, "DiffusionNFT with CFG", [f"diffusion_nft_cfg@{lr}" for lr in rates]),
                            (free, "DiffusionNFT without CFG", [f"diffusion_nft@{lr}" for lr in rates])):
        for label in labels:
            m = p["methods"].get(label)
            if m is None:
                continue
            base = " / ".join(f"{p['base_by_split'][sp]:.3f}" for sp in ("val", "test"))
            r = significance(m["final"], ref["final"])
            t = "reference" if m is ref else ("n/a (one seed)" if r["word"] == "too few seeds" else stat_text(r))
            rows.append(f"| {name} | {label.split('@')[1]} | {len(m['seeds'])} | {base} | {fmt(ms(m['final']))} | "
                        f"{fmt(ms(m['final_by_split']['test']))} | {fmt(ms(m['kl']))} | {reached_cell(p, m)} | {t} |")
    return rows


def ablation_table(p: dict) -> list[str]:
    """docs/op_grpo.md's ablation table for one panel (``tier2op_ablations`` or ``sparse_ablations``): per committed
    run, its seeds, final score, Welch's test of the final score against the described form (:func:`significance`:
    t, df, p), KL to the base and
    off-policy clip fraction, mean +- std over seeds (tests/test_docs.py checks the page against this)."""
    rows = ["| run | seeds | final strict | vs the described form | KL to the base | off-policy clip fraction |",
            "|---|---|---|---|---|---|"]
    ref = p["methods"].get("op_grpo@0.001")
    for label, name in ABLATION_ROWS.items():
        m = p["methods"].get(label)
        if m is None:
            continue
        r = None if label == "op_grpo@0.001" or ref is None else significance(m["final"], ref["final"])
        vs = ("reference" if label == "op_grpo@0.001" else
              "n/a (one seed)" if r is None or r["word"] == "too few seeds" else stat_text(r))
        clip = ms(m["clip_off"])
        clip_text = "n/a" if clip is None else (
            f"{100 * clip[0]:.1f}%" if clip[1] is None else fmt(clip, percent=True))
        rows.append(
            f"| {name} | {len(m['seeds'])} | {fmt(ms(m['final']))} | {vs} | {fmt(ms(m['kl']))} | {clip_text} |")
    return rows


# ------------------------------------------------------------------------------------------------- the claims
SHORT = {"tier2": "set A", "tier2b": "set B", "tier2op": "set A", "sparse": "sparse tier",
         "sparse_ablations": "sparse tier",
         "tier2op_ablations": "set A", "nft": "set A without CFG", "nft_cfg": "set A with CFG", "edit": "editing tier",
         "nft_t3": "tier 3 without CFG",
         "nft_cfg_b": "set B with CFG", "nft_t3_cfg": "tier 3 with CFG", "nft_cpu": "set A, one machine",
         "tier3": "tier 3", "layout": "set A", "layout_b": "set B", "unirl": "set A", "unirl_b": "set B",
         "g4_one": "set A", "g4_one_sparse": "sparse tier", "fast": "set A"}


def cell(p: dict | None, a: str, b: str | None, field: str = "final",
         better: str | None = None) -> tuple[str, dict | None]:
    """One measured comparison as a short cell and its :func:`significance` result (None: no test): ``a`` against
    ``b`` (Welch), or against the base (``b`` None: the seeds' mean against the base and its binomial error)."""
    if p is None or a not in p["methods"] or (b is not None and b not in p["methods"]):
        return "not measured yet", None
    if b is None:
        f = ms(p["methods"][a][field])
        r = gain(p, a, field, better)
        base = f"{p['base']:.3f}" + (f" (s.e. {p['base_se']:.3f})" if p.get("base_se") else "")
        if r["word"] == "too few seeds":  # one seed: no spread, no test
            return f"{base} -> {fmt(f)}", None
        return f"{base} -> {fmt(f)}, {stat_text(r)}", r
    if field == "cpu_to_target" and not same_machine(p["methods"][a]["calibration"] + p["methods"][b]["calibration"]):
        return "runs of different or unrecorded machines: CPU not compared", None
    c = compare(p, a, b, field, better)
    if c is None:
        if field.endswith("_target"):  # one side (or both) never reached it: say which
            n_a, n_b = (sum(x is not None for x in p["methods"][lab][field]) for lab in (a, b))
            return (f"seeds reaching the target {n_a}/{len(p['methods'][a][field])} vs "
                    f"{n_b}/{len(p['methods'][b][field])}; not tested (a seed never reached it)"), None
        return "target not reached", None
    nd = 4 if field == "kl_at_target" else (0 if field in ("cpu_to_target", "steps_to_target") else 3)
    ratio = f" ({c['ratio']:.2f}x)" if field != "final" and c["ratio"] is not None else ""
    r = c["test"]
    test = "" if r["word"] == "too few seeds" else f", {stat_text(r)}"
    n_a, n_b = len(p["methods"][a][field]), len(p["methods"][b][field])
    reached = f", seeds reaching it {c['na']}/{n_a} vs {c['nb']}/{n_b}" if field.endswith("_target") else ""
    if reached and (c["na"] < n_a or c["nb"] < n_b):
        # a seed that never reached the target has no value: a t over the others would drop a side's failures
        return f"{fmt(c['a'], nd)} vs {fmt(c['b'], nd)}{ratio}{reached}; not tested (a seed never reached it)", None
    pct = field == "clip_off"  # printed as percentages, as the paper and docs/op_grpo.md give them
    return f"{fmt(c['a'], nd, pct)} vs {fmt(c['b'], nd, pct)}{ratio}{test}{reached}", \
        (None if r["word"] == "too few seeds" else r)


def detectable_text(r: dict | None, field: str, censored: bool = False) -> str | None:
    """A tested cell's smallest detectable difference in the compared value's units and the seeds it rests on (``+``
    where ``censored``: :func:`censored_detectable`); None without one."""
    if r is None or r["mdd"] is None:
        return None
    if field == "clip_off":
        value = f"{100 * r['mdd']:.1f} points"
    elif field in ("cpu_to_target", "steps_to_target"):
        value = f"{r['mdd']:.0f} " + ("CPU-s" if field == "cpu_to_target" else "iterations")
    else:
        value = f"{r['mdd']:.4f}" if field == "kl_at_target" else f"{r['mdd']:.3f}"
    seeds = f"{r['na']} seeds" if r["nb"] is None else f"{r['na']} vs {r['nb']} seeds"
    return f"{value}{'+' if censored else ''} ({seeds})"


def censored_detectable(p: dict | None, a: str, b: str | None, field: str) -> str | None:
    """The smallest detectable difference of a speed cell left untested because a seed never reached the target: the
    same test with each such seed counted at the end of its run (a lower bound on its value), so the stated figure
    shows the seeds' resolution without claiming a verdict; marked ``+`` (:data:`RULE` says so); None where it does
    not apply."""
    if p is None or b is None or field not in ("steps_to_target", "cpu_to_target"):
        return None
    ms_ = [p["methods"].get(lab) for lab in (a, b)]
    if not all(m and "run_end" in m for m in ms_) or all(x is not None for m in ms_ for x in m[field]):
        return None  # a side not measured, or nothing censored (the cell's own test, or none, stands)
    if field == "cpu_to_target" and not same_machine(ms_[0]["calibration"] + ms_[1]["calibration"]):
        return None  # CPU seconds of different machines are not compared
    sides = [[end if x is None else x for x, end in zip(m[field], m["run_end"][field])] for m in ms_]
    return detectable_text(significance(*sides), field, censored=True)


def same_machine(calibrations) -> bool:
    """CPU seconds compare only between runs whose machine record (``calibration_s``, benchmarks/shapes.py
    ``machine_info``) exists and agrees within 25%, the rule of the benchmark's own summaries."""
    return all(c is not None for c in calibrations) and max(calibrations) <= 1.25 * min(calibrations)


def verdict(results: list[dict | None]) -> str:
    """Words for the cells' :func:`significance` results (None: a cell without a test), each result's own ``word``
    (tested in the direction the claim predicts) counted as it is."""
    got = [r for r in results if r is not None]
    if not got:
        return "not measured yet"
    words = [r["word"] for r in got]
    part = "" if len(got) == len(results) else " (so far)"
    if set(words) == {"no spread"}:
        return f"no spread{part}"
    held, against = words.count("holds"), words.count("the opposite")
    if "differs" in words:  # a two-sided row (no predicted direction)
        return f"differs on {words.count('differs')} of {len(words)}{part}"
    spread = "" if "no spread" not in words else f", no spread on {words.count('no spread')}"
    if held == len(words):
        return f"holds{part}"
    if against:
        return f"the opposite on {against} of {len(words)}{spread}{part}"
    if held:
        return f"holds on {held} of {len(words)}, within the noise elsewhere{spread}{part}"
    return f"within the noise{spread}{part}"


def with_tier3(panel: str, lr: float) -> tuple[str, ...]:
    """A tier-2 DiffusionNFT panel and, at the one rate tier 3 measured Flow-GRPO at (1e-3), its tier-3 twin (and,
    with CFG, its set-B twin)."""
    if lr != 1e-3:
        return (panel,)
    return (panel, *(("nft_cfg_b",) if panel == "nft_cfg" else ()), panel.replace("nft", "nft_t3", 1))


# (method, claim, paper's figure, panels, a, b, per-seed field, the direction the claim predicts)
CLAIMS = [
    ("Flow-GRPO", "improves the base", "GenEval 0.63 -> 0.95", ("tier2", "tier2b"), "flow_grpo@0.001", None,
     "final", "higher"),
    ("Flow-DPPO", "beats Flow-GRPO at 1 epoch each (4 optimizer steps an iteration)", "GenEval2 78.9 vs 56.6",
     ("tier2", "tier2b"), "flow_dppo_1epoch@0.001", "flow_grpo@0.001", "final", "higher"),
    ("Flow-DPPO", "beats Flow-GRPO at 2 epochs each (8 optimizer steps)", "GenEval2 78.9 vs 56.6",
     ("tier2", "tier2b"), "flow_dppo@0.001", "flow_grpo_2epochs@0.001", "final", "higher"),
    ("(control)", "Flow-GRPO: what a second epoch alone is worth", "", ("tier2", "tier2b"),
     "flow_grpo_2epochs@0.001", "flow_grpo@0.001", "final", "higher"),
    ("Flow-DPPO", "lower KL to the base at a matched score, 1 epoch each", "0.50x", ("tier2", "tier2b"),
     "flow_dppo_1epoch@0.001", "flow_grpo@0.001", "kl_at_target", "lower"),
    ("Flow-DPPO", "lower KL to the base at a matched score, 2 epochs each", "0.50x", ("tier2", "tier2b"),
     "flow_dppo@0.001", "flow_grpo_2epochs@0.001", "kl_at_target", "lower"),
    *[("Stepwise", f"less CPU to the target than Flow-GRPO, T'={t}", "0.6-0.8x wall-clock", ("tier2", "tier2b"),
       label, "flow_grpo@0.001", "cpu_to_target", "lower")
      for t, label in (("2", "stepwise_t2@0.001"), ("3", "stepwise_t3@0.001"), ("5", "stepwise@0.001"))],
    ("Stepwise", "higher final score than Flow-GRPO, T'=2", "GenEval 0.71 vs 0.68", ("tier2", "tier2b"),
     "stepwise_t2@0.001", "flow_grpo@0.001", "final", "higher"),
    *[("OP-GRPO", f"reaches the target in fewer iterations than Flow-GRPO, lr {lr:g} (same samples, 1 epoch each)",
       "0.342x the steps", ("tier2op", "sparse"), f"op_grpo@{lr:g}", f"flow_grpo@{lr:g}", "steps_to_target", "lower")
      for lr in (5e-4, 1e-3, 2e-3)],
    ("OP-GRPO", "the same or a better final score than Flow-GRPO, lr 0.001", "+1.17% on average",
     ("tier2op", "sparse"),
     "op_grpo@0.001", "flow_grpo@0.001", "final", "higher"),
    ("OP-GRPO", "removing the off-policy correction hurts (lr 0.001)", "diverges",
     ("tier2op_ablations", "sparse_ablations"), "op_grpo@0.001", "op_grpo_no_correction@0.001", "final", "higher"),
    ("OP-GRPO", "removing the truncation hurts (lr 0.001)", "unstable", ("tier2op_ablations", "sparse_ablations"),
     "op_grpo@0.001", "op_grpo_no_truncation@0.001", "final", "higher"),
    ("OP-GRPO", "the per-step ratio clips more replayed steps than the sequence weight (lr 0.001)",
     "> 40% vs 11.8%", ("tier2op_ablations", "sparse_ablations"), "op_grpo_per_step@0.001", "op_grpo@0.001",
     "clip_off", "higher"),
    *[("DiffusionNFT", f"improves the base without CFG, lr {lr:g} (base: the model sampled without CFG)",
       "GenEval 0.24 -> 0.98 without CFG", ("nft", "nft_t3"), f"diffusion_nft@{lr:g}", None, "final", "higher")
      for lr in (5e-4, 1e-3, 2e-3)],
    *[("DiffusionNFT", f"without CFG, reaches Flow-GRPO's target score in fewer iterations than Flow-GRPO with CFG, "
       f"lr {lr:g} (same samples, 4 optimizer steps an iteration each)", "up to 25x Flow-GRPO's efficiency",
       with_tier3("nft", lr),
       f"diffusion_nft@{lr:g}", f"flow_grpo@{lr:g}", "steps_to_target", "lower") for lr in (5e-4, 1e-3, 2e-3)],
    ("DiffusionNFT", "without CFG, less CPU to Flow-GRPO's target than Flow-GRPO with CFG, lr 0.0005 (one machine)",
     "up to 25x Flow-GRPO's efficiency", ("nft_cpu",), "diffusion_nft@0.0005", "flow_grpo@0.0005", "cpu_to_target",
     "lower"),
    ("DiffusionNFT", "with CFG, less CPU to the target than Flow-GRPO, lr 0.0005 (one machine)",
     "up to 25x Flow-GRPO's efficiency", ("nft_cpu",), "diffusion_nft_cfg@0.0005", "flow_grpo@0.0005",
     "cpu_to_target", "lower"),
    *[("DiffusionNFT", f"with CFG, reaches the target in fewer iterations than Flow-GRPO, lr {lr:g}",
       "up to 25x Flow-GRPO's efficiency", with_tier3("nft_cfg", lr), f"diffusion_nft_cfg@{lr:g}", f"flow_grpo@{lr:g}",
       "steps_to_target", "lower") for lr in (5e-4, 1e-3, 2e-3)],
    ("DiffusionNFT", "with CFG, the same or a better final score than Flow-GRPO, lr 0.001", "",
     with_tier3("nft_cfg", 1e-3), "diffusion_nft_cfg@0.001", "flow_grpo@0.001", "final", "higher"),
    *[("Flow-GRPO", f"improves an editing model's edit success on fresh source scenes (lr {lr}, beta 0.04)", "",
       ("edit",), f"flow_grpo@{float(lr):g}", None, "final", "higher") for lr in ("5e-4", "1e-3")],
    ("Flow-GRPO", "improves held-out prompts (sharp base, lr 5e-4)", "", ("tier3",), "flow_grpo@0.0005", None,
     "final", "higher"),
    ("Flow-DPPO", "beats Flow-GRPO on held-out prompts (2 epochs vs 1: not matched)", "GenEval2 78.9 vs 56.6",
     ("tier3",), "flow_dppo@0.0005", "flow_grpo@0.0005", "final", "higher"),
    *[(method, "(batches) mixed-prompt update microbatches, the released code's, against prompt by prompt: final "
       "score (two-sided)", "", ("layout", "layout_b"), f"{label}_mixed@0.001", f"{label}@0.001", "final", None)
      for method, label in (("Flow-GRPO", "flow_grpo"), ("Flow-DPPO", "flow_dppo_1epoch"),
                            ("DiffusionNFT", "diffusion_nft_cfg"))],
    ("Flow-DPPO", "in its released code's form (3 random SDE steps of the first 5, CFG 1) beats Flow-GRPO on the "
     "same steps and CFG", "GenEval2 78.9 vs 56.6", ("unirl", "unirl_b"), "flow_dppo_unirl@0.001",
     "flow_grpo_unirl_steps@0.001", "final", "higher"),
    ("Flow-DPPO", "in its released code's form, lower KL to the base at a matched score than Flow-GRPO on the same "
     "steps and CFG", "0.50x", ("unirl", "unirl_b"), "flow_dppo_unirl@0.001", "flow_grpo_unirl_steps@0.001",
     "kl_at_target", "lower"),
    ("OP-GRPO", "at G = 4 in the form where both descriptions hold, reaches the target in fewer iterations than "
     "Flow-GRPO at G = 4, lr 0.0005", "0.342x the steps", ("g4_one", "g4_one_sparse"), "op_grpo_g4_one@0.0005",
     "flow_grpo_g4@0.0005", "steps_to_target", "lower"),
    ("OP-GRPO", "at G = 4 in that form, the same or a better final score than Flow-GRPO at G = 4, lr 0.0005",
     "+1.17% on average", ("g4_one", "g4_one_sparse"), "op_grpo_g4_one@0.0005", "flow_grpo_g4@0.0005", "final",
     "higher"),
    ("Flow-GRPO-Fast", "less CPU to the target than Flow-GRPO (one machine)", "faster training", ("fast",),
     "flow_grpo_fast_mixed@0.001", "flow_grpo_mixed@0.001", "cpu_to_target", "lower"),
    ("Flow-GRPO-Fast", "reaches the target in as few iterations as Flow-GRPO (two-sided)", "", ("fast",),
     "flow_grpo_fast_mixed@0.001", "flow_grpo_mixed@0.001", "steps_to_target", None),
    ("Flow-GRPO-Fast", "the same final score as Flow-GRPO at the same iterations (two-sided)", "comparable",
     ("fast",), "flow_grpo_fast_mixed@0.001", "flow_grpo_mixed@0.001", "final", None),
]


def why_not(cell_text: str) -> str:
    """Why a cell has no test: its reason in a few words."""
    if "CPU not compared" in cell_text:
        return "machines differ"
    if "a seed never reached it" in cell_text:
        return "a seed never reached the target"
    if " vs " in cell_text or " -> " in cell_text:
        return "too few seeds"
    return "not measured" if cell_text == "not measured yet" else cell_text


def claim_verdict(where, cells, better: str) -> str:
    """The verdict of one claim over its panels: :func:`verdict` on the panels with a test, and each other panel's
    reason by name (a panel that cannot be compared never hides one that can, and the reverse)."""
    results = [r for _, r in cells]
    if all(r is None for r in results):
        reasons = {why_not(c) for c, _ in cells}
        if reasons == {"too few seeds"}:
            return "too few seeds yet"
        if reasons == {"machines differ"}:
            return "not comparable yet (machines differ)"
        if reasons == {"a seed never reached the target"}:
            return "not tested (a seed never reached the target)"
        return "not yet: " + "; ".join(f"{SHORT[pn]} {why_not(c)}" for pn, (c, _) in zip(where, cells))
    v = verdict([r for r in results if r is not None])
    missing = [(pn, c) for pn, (c, r) in zip(where, cells) if r is None]
    if missing:
        on = ", ".join(SHORT[pn] for pn, (_, r) in zip(where, cells) if r is not None)
        v += f" on {on} (" + "; ".join(f"{SHORT[pn]}: {why_not(c)}" for pn, c in missing) + ")"
    return v


def claims(panels: dict) -> list[tuple]:
    """(method, claim, paper, cell per set, smallest detectable difference per set, verdict) rows; every number from
    ``panels`` through :func:`significance`."""
    rows = []
    for method, claim, paper, where, a, b, field, better in CLAIMS:
        cells = [cell(panels.get(pname), a, b, field, better) for pname in where]
        text = "; ".join(f"{SHORT[pname]}: {c}" for pname, (c, _) in zip(where, cells))
        mdd = "; ".join(f"{SHORT[pname]} {d}" for pname, (_, r) in zip(where, cells)
                        if (d := detectable_text(r, field) or censored_detectable(panels.get(pname), a, b, field))
                        is not None) or "n/a"
        v = claim_verdict(where, cells, better)
        few = [pn for pn, (_, r) in zip(where, cells) if r is not None and any(
            lab in panels[pn]["methods"] and len(panels[pn]["methods"][lab][field]) < 3 for lab in (a, b) if lab)]
        if few:  # a verdict resting on fewer than 3 seeds a side is provisional
            v += " (so far: fewer than 3 seeds on " + ", ".join(SHORT[pn] for pn in few) + ")"
        rows.append((method, claim, paper, text, mdd, v))
    return rows


# ------------------------------------------------------------------------------------------------- figures
def figure(name: str, p: dict) -> str:
    """One row of three axes (score vs iteration, vs CPU-seconds, vs KL to the base): per method the mean over seeds
    with a band of +- one std. Returns the PNG's path relative to docs/."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = PANELS[name]["methods"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for i, (label, m) in enumerate(p["methods"].items()):
        n = min(len(c) for c in m["curves"])
        cols = [list(zip(*[c[j] for c in m["curves"]])) for j in range(n)]  # per eval point: (steps, cpus, kls, ys)
        y = [statistics.mean(c[3]) for c in cols]
        sd = [statistics.stdev(c[3]) if len(c[3]) > 1 else 0.0 for c in cols]
        for ax, xi in zip(axes, (0, 1, 2)):
            x = [statistics.mean(c[xi]) for c in cols]
            ax.plot(x, y, color=f"C{i}", marker=".", label=f"{names[label]} ({len(m['curves'])} seeds)")
            ax.fill_between(x, [a - b for a, b in zip(y, sd)], [a + b for a, b in zip(y, sd)], color=f"C{i}",
                            alpha=0.15, linewidth=0)
    for ax, xl in zip(axes, ("iteration", "CPU seconds of training (one core, mean over seeds)",
                             "KL to the base model (mean over seeds)")):
        ax.axhline(p["base"], color="grey", lw=0.8, ls=":")
        ax.set_xlabel(xl, fontsize=8)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"{p['score']} accuracy, {p['split']} prompts")
    axes[0].legend(fontsize=7)
    fig.suptitle(PANELS[name]["title"] + "; mean +- std over seeds, dotted: the base", fontsize=9)
    fig.tight_layout()
    os.makedirs(FIGURES, exist_ok=True)
    fig.savefig(os.path.join(FIGURES, f"{name}.png"), dpi=90)
    plt.close(fig)
    return f"figures/{name}.png"


# ------------------------------------------------------------------------------------------------- the page
def render(panels: dict) -> str:
    rows = claims(panels)
    lines = [
        "# Results: which trainer, and what each paper's claim came to here",
        "",
        "<!-- Generated by `python benchmarks/results_page.py` from committed `benchmarks/results/*/results.json`; "
        "do not edit by hand (tests/test_docs.py re-renders it). -->",
        "",
        "Measured on the shapes task (docs/shapes.md): a tiny SD3 model trained here draws coloured shapes, a "
        "detector scores whether an image shows what the prompt says (*strict*: colours, shapes, counts and the "
        "relation all right). Every run is on CPU, one thread, with the same samples per iteration (8 prompts x 16 "
        "images); evaluations use noise never used in training. Mean +- std over seeds.",
        "",
        RULE,
        "",
        "## Which trainer when",
        "",
        "- **Flow-GRPO** (`FlowGRPOTrainer`): the baseline; its mean score ended above the base on every tier here, "
        "but at three seeds the gain clears the seeds' spread and the base's own sampling error only on some (its "
        "rows below).",
        "- **Flow-DPPO** (`FlowDPPOTrainer`): when you reuse each rollout for several updates; read its rows below "
        "for what survives at matched updates.",
        "- **Stepwise-Flow-GRPO** (`StepwiseFlowGRPOTrainer`): per-step credit; its cost is T' extra transformer "
        "calls per state, see the CPU-to-target rows.",
        "- **OP-GRPO** (`OPGRPOTrainer`): replays good trajectories (a quarter of the samples, only the last tenth "
        "of the steps regenerated); here it saved no iterations on tier 2 or the sparse tier at any of three rates, "
        "and ended nearer the base (about half Flow-GRPO's KL) at the same score: choose it for that, not for speed.",
        "- **DiffusionNFT** (`DiffusionNFTTrainer`): no log-probs, any sampler, CFG-free by default; trains on the "
        "forward (noising) process. On tier 2, sampled without CFG (from a lower base, the model without CFG) it "
        "reached Flow-GRPO's target no sooner than Flow-GRPO with CFG, and ended at or above its score at a fifth or "
        "less of its KL, at three rates. With CFG it ended above Flow-GRPO at all three rates (beyond the noise at "
        "1e-3 and 2e-3) at a third of its KL or less, and reached the target sooner on average at every rate, within "
        "the noise where tested.",
        "",
        "## Claims, per method",
        "",
        "| method | claim | paper | ours (mean +- std over seeds; t, df, p: Welch's, or the seeds against the base "
        "and its s.e.) | smallest detectable difference (80% power, p < 0.05) | verdict |",
        "|---|---|---|---|---|---|",
    ]
    lines += [f"| {' | '.join(r)} |" for r in rows]
    lines += ["", "Target: the base plus 0.8 x Flow-GRPO's mean final gain on that tier. Iterations to the target: "
              "where the score crossed it, linear between the two evaluations that bracket the crossing (runs are "
              "evaluated every 10 iterations or so; the panels give the first evaluation reaching it beside it). "
              "CPU and KL at the target: a seed's values at its first evaluation reaching it.", ""]
    for name, p in panels.items():
        if p is None or not p["methods"]:
            continue
        lines += [f"## {PANELS[name]['title']}", "", f"![{name}]({figure(name, p)})", "",
                  "| run | seeds | final | KL to base | iterations to target (interpolated) | iterations to target "
                  "(first evaluation reaching it) | CPU-s per iteration |",
                  "|---|---|---|---|---|---|---|"]
        for label, m in p["methods"].items():
            lines.append(f"| {PANELS[name]['methods'][label]} | {len(m['seeds'])} | {fmt(ms(m['final']))} | "
                         f"{fmt(ms(m['kl']), 4)} | {reached_cell(p, m, 'steps_to_target', 1)} | "
                         f"{reached_cell(p, m)} | {fmt(ms(m['cpu_per_iter']), 1)} |")
        base = f"Base: {p['base']:.3f}" + (f" (one evaluation of {p['base_n']} images, binomial s.e. "
                                            f"{p['base_se']:.3f})" if p["base_n"] else "")
        lines += ["", f"{base}; {folders_note(PANELS[name])}.{committed_note(p)}", ""]
    lines += ["## Before / after", "",
              "The main job (`python examples/quickstart.py`): one row per trained prompt, before training and after, "
              "same noise.", "", "![before / after](../benchmarks/results/quickstart/before_after.png)", "",
              "The history of every run, sweep and ablation is the lab notebook, [history.md](history.md).", ""]
    return "\n".join(lines)


README = os.path.join(ROOT, "README.md")
README_START = "<!-- results table: generated by benchmarks/results_page.py from committed results; do not edit -->"
README_END = "<!-- end of results table -->"
# the README's rows: indices into CLAIMS (at most ten lines with the header and the figure)
README_ROWS = (0, 1, 2, 4, 6, 11)


def readme_block(panels: dict) -> str:
    """The README's summary: a few claim rows (tier 2, sets A and B) and the tier-2 figure."""
    rows = claims(panels)
    lines = [README_START,
             "| method | claim (the paper's figure) | tier 2, prompt set A | set B, or the sparse tier "
             "| smallest detectable difference | verdict (p < 0.05, docs/results.md) |", "|---|---|---|---|---|---|"]
    for i in README_ROWS:
        method, claim, paper, ours, mdd, v = rows[i]
        parts = re.split(r"; (?=set B: |sparse tier: )", ours, maxsplit=1)
        first, second = parts[0], parts[1] if len(parts) > 1 else "not measured"
        first = first.removeprefix("set A: ")
        second = second.removeprefix("set B: ")
        lines.append(f"| {method} | {claim} ({paper}) | {first} | {second} | {mdd} | {v} |")
    lines += ["", "![tier 2: score vs iteration, CPU and KL, mean +- std over seeds](docs/figures/tier2.png)",
              README_END]
    return "\n".join(lines)


def with_readme_block(text: str, block: str) -> str:
    if README_START not in text or README_END not in text:
        raise SystemExit(f"README.md has no results block ({README_START!r} ... {README_END!r})")
    head, rest = text.split(README_START, 1)
    return head + block + rest.split(README_END, 1)[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/results.md is not what the results give")
    args = ap.parse_args(argv)
    panels = {name: load_panel(name) for name in PANELS}
    if args.check:
        import tempfile

        global FIGURES
        FIGURES = tempfile.mkdtemp()  # the check never rewrites the committed figures
        with open(PAGE) as f:
            same = f.read() == render(panels)
        with open(README) as f:
            text = f.read()
        same_readme = text == with_readme_block(text, readme_block(panels))
        print("docs/results.md is up to date" if same else "docs/results.md differs: run benchmarks/results_page.py")
        print("README.md's results table is up to date" if same_readme
              else "README.md's results table differs: run benchmarks/results_page.py")
        return 0 if same and same_readme else 1
    page = render(panels)
    with open(PAGE, "w") as f:
        f.write(page)
    with open(README) as f:
        text = f.read()
    with open(README, "w") as f:
        f.write(with_readme_block(text, readme_block(panels)))
    print(f"wrote {os.path.relpath(PAGE, ROOT)} ({len(page.splitlines())} lines), its figures and README.md's table")
    return 0


if __name__ == "__main__":
    sys.exit(main())
