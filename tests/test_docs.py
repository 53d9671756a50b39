"""The docs stay true: every python block of README.md and docs/*.md parses, every `trl-flow ...` command line in
them (and in the shipped recipes' and accelerate configs' comments) is accepted by the CLI parser, and every
generated config table matches its dataclass.

Config tables sit between ``<!-- config-table: ClassName -->`` and ``<!-- /config-table -->``; regenerate them with
``python tests/test_docs.py --update`` after changing a config (a table whose class this version lacks is left
as it is and checked once the class exists).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import glob
import json
import os
import re
import shlex
import statistics
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = sorted([os.path.join(ROOT, "README.md"), *glob.glob(os.path.join(ROOT, "docs", "*.md"))])
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
TABLE = re.compile(r"(<!-- config-table: (\w+) -->\n)(.*?)(<!-- /config-table -->)", re.S)


def _rel(path):
    return os.path.relpath(path, ROOT)


def python_blocks():
    for page in PAGES:
        for m in BLOCK.finditer(open(page, encoding="utf-8").read()):
            if m.group(1) == "python":
                yield page, m.group(2)


def command_lines():
    """(source, line) of every `trl-flow ...` command: in code blocks of the pages, and in the `#   trl-flow` comment
    lines of the shipped YAML files. Backslash continuations are joined; leading VAR=value assignments dropped."""
    sources = [(p, m.group(2)) for p in PAGES for m in BLOCK.finditer(open(p, encoding="utf-8").read())]
    for yml in sorted(glob.glob(os.path.join(ROOT, "trl_flow", "*", "*.yaml"))):
        comments = [line[1:].strip() for line in open(yml, encoding="utf-8") if line.startswith("#")]
        sources.append((yml, "\n".join(comments)))
    for source, text in sources:
        for line in text.replace("\\\n", " ").splitlines():
            if not re.match(r"\s*(?:[A-Z_][A-Z0-9_]*=\S*\s+)*trl-flow\b", line):
                continue
            tokens = shlex.split(line, comments=True)
            while tokens and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", tokens[0]):
                tokens.pop(0)
            if tokens and tokens[0] == "trl-flow":
                yield source, tokens


def config_table(cls) -> str:
    """The markdown table of a config class: the fields it adds to FlowRLConfig or whose default it changes (all
    fields for FlowRLConfig itself), with default and help."""
    from trl_flow import FlowRLConfig

    base = {f.name: f for f in dataclasses.fields(FlowRLConfig)}

    def default(f):
        if f.default is not dataclasses.MISSING:
            return f.default
        if f.default_factory is not dataclasses.MISSING:
            return f.default_factory()
        return None

    resumable = any("resume" in f.metadata for f in dataclasses.fields(cls))
    rows = (["| field | default | on resume | meaning |", "|---|---|---|---|"] if resumable
            else ["| field | default | meaning |", "|---|---|---|"])
    for f in dataclasses.fields(cls):
        if cls is not FlowRLConfig and f.name in base and default(base[f.name]) == default(f):
            continue
        value = default(f)
        shown = value if isinstance(value, str) else repr(value)
        text = f.metadata.get("help", "").replace("|", "\\|").replace("\n", " ")
        resume = f" {f.metadata.get('resume', '')} |" if resumable else ""
        rows.append(f"| `{f.name}` | `{shown}` |{resume} {text} |")
    if len(rows) == 2:
        return f"`{cls.__name__}` has no fields or defaults of its own: the shared fields apply as they are.\n"
    return "\n".join(rows) + "\n"


def _table_class(name):
    import trl_flow
    from trl_flow import cli

    return getattr(cli, name, None) or getattr(trl_flow, name, None)


def test_python_blocks_parse():
    blocks = list(python_blocks())
    assert len(blocks) >= 9  # the trainer pages, cli, migration, README
    for page, code in blocks:
        try:
            ast.parse(code)
        except SyntaxError as e:
            pytest.fail(f"{_rel(page)}: python block does not parse: {e}\n{code}")


def test_command_lines_are_accepted_by_the_parser(capsys):
    from trl_flow import cli

    lines = list(command_lines())
    assert len(lines) >= 20
    commands = set()
    for source, tokens in lines:
        command, args = (tokens[1] if len(tokens) > 1 else None), tokens[2:]
        where = f"{_rel(source)}: {' '.join(tokens)}"
        if command is None or command in ("-h", "--help"):
            continue
        assert command in (*cli.commands(), cli.REWARD_SERVER), f"{where}: unknown command"
        commands.add(command)
        if command == cli.REWARD_SERVER:
            continue  # its options belong to trl_flow.rewards.server
        if "-h" in args or "--help" in args:
            with pytest.raises(SystemExit) as exit_info:
                cli.parse_args(command, args)
            assert exit_info.value.code == 0, where
            continue
        try:
            cli.parse_args(command, args)
        except (cli.CLIError, SystemExit) as e:
            pytest.fail(f"{where}: rejected by the parser: {e}")
    capsys.readouterr()
    assert {"grpo", "op-grpo", "stepwise", "dppo"} <= commands


def test_config_tables_match_the_config_classes():
    tables = [(page, m.group(2), m.group(3)) for page in PAGES
              for m in TABLE.finditer(open(page, encoding="utf-8").read())]
    names = {name for _, name, _ in tables}
    assert {"FlowRLConfig", "FlowGRPOConfig", "OPGRPOConfig", "StepwiseFlowGRPOConfig", "FlowDPPOConfig",
            "ScriptArguments"} <= names
    for page, name, table in tables:
        cls = _table_class(name)
        if cls is None:  # a trainer of a later version: checked once it exists
            continue
        assert table == config_table(cls), (f"{_rel(page)}: the {name} table is stale; "
                                            "run python tests/test_docs.py --update")


# ------------------------------------------------------------------------------- numbers quoted from results
QUICKSTART_RESULTS = os.path.join(ROOT, "benchmarks", "results", "quickstart", "scores.json")


def _quickstart():
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("quickstart_for_docs",
                                                  os.path.join(ROOT, "examples", "quickstart.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with open(QUICKSTART_RESULTS, encoding="utf-8") as f:
        return mod, json.load(f)


QUICKSTART_SEEDS = os.path.join(ROOT, "benchmarks", "results", "quickstart", "seeds.json")


def test_readme_quickstart_numbers_are_the_committed_seeds():
    """README.md quotes exactly the sentence the quickstart makes of benchmarks/results/quickstart/seeds.json (the
    quickstart over >= 5 seeds, scripts/quickstart_seeds.py): median and range, never typed by hand; the committed
    seed-0 run is one of them; and every seed shows the gain the README promises (>= +0.10 strict, trained prompts)."""
    quickstart, scores = _quickstart()
    with open(QUICKSTART_SEEDS, encoding="utf-8") as f:
        seeds = json.load(f)
    readme = _page_text("README.md")
    sentence = quickstart.readme_seeds_summary(seeds)
    assert sentence in readme, (f"README.md's quickstart numbers differ from {_rel(QUICKSTART_SEEDS)}: "
                                f"expected\n{sentence}")
    assert len(seeds["seeds"]) >= 5
    gains = [r["trained_prompts"]["strict"][1] - r["trained_prompts"]["strict"][0] for r in seeds["seeds"].values()]
    assert min(gains) >= 0.10 and seeds["gains"]["trained_prompts/strict"]["min"] == pytest.approx(min(gains))
    seed0 = seeds["seeds"]["0"]["trained_prompts"]["strict"]
    assert seed0 == [scores["trained_prompts"][w]["overall"]["strict"] for w in ("before", "after")]
    run = {k: v for k, v in scores["run"].items() if k not in ("train_cpu_s", "train_wall_s")}
    assert run == {k: v for k, v in seeds["seeds"]["0"]["run"].items() if k not in ("train_cpu_s", "train_wall_s")}
    for split in ("trained_prompts", "held_out_prompts"):  # the file has the shape quickstart.py writes
        for when in ("before", "after"):
            assert {"strict", "partial", "n"} <= set(scores[split][when]["overall"])
    assert {"seed", "steps", "threads", "train_cpu_s"} <= set(scores["run"])


def _committed_summary(folder: str) -> dict:
    """benchmarks/results/<folder>/summary.json, as committed."""
    with open(os.path.join(ROOT, "benchmarks", "results", folder, "summary.json"), encoding="utf-8") as f:
        return json.load(f)


def _page_text(page: str) -> str:
    """A page of the repository with its whitespace collapsed, so quoted numbers may wrap."""
    return " ".join(open(os.path.join(ROOT, page), encoding="utf-8").read().split())


HISTORY = os.path.join("docs", "history.md")  # the lab notebook: every run, sweep and search


def _former_readme_summary() -> str:
    """The README's benchmark paragraph before the results page, kept in docs/history.md."""
    text = _page_text(HISTORY)
    start = text.index("## The README's summary before the results page")
    return text[start: text.index("## ", start + 3)]


def _results_page():
    """benchmarks/results_page.py as a fresh module (a test may set its FIGURES without touching another's)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("results_page", os.path.join(ROOT, "benchmarks", "results_page.py"))
    page = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(page)
    return page


def test_results_page_and_readme_table_are_the_committed_results():
    """docs/results.md and README.md's results table are what benchmarks/results_page.py renders from the committed
    results (so every number they quote is a committed one), the README table stays within ten lines, and a
    changed result changes the page."""
    import subprocess
    import tempfile

    page = _results_page()
    known = subprocess.run(["git", "cat-file", "-e", page.CODE_RECORDED_AFTER], cwd=ROOT, capture_output=True)
    if known.returncode:  # a tarball or shallow clone: the page's "committed in" lists need the history
        pytest.skip(f"no git history back to {page.CODE_RECORDED_AFTER} here; the page names commits from it")

    page = _results_page()
    page.FIGURES = tempfile.mkdtemp()
    panels = {name: page.load_panel(name) for name in page.PANELS}
    assert open(os.path.join(ROOT, "docs", "results.md"), encoding="utf-8").read() == page.render(panels), \
        "docs/results.md is stale: run python benchmarks/results_page.py"
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    block = page.readme_block(panels)
    assert block in readme, "README.md's results table is stale: run python benchmarks/results_page.py"
    assert len([ln for ln in block.splitlines() if ln.strip() and not ln.startswith("<!--")]) <= 10
    for name in ("tier2", "tier3"):
        assert f"figures/{name}.png" in page.render(panels) and os.path.exists(
            os.path.join(ROOT, "docs", "figures", f"{name}.png")), name
    # the numbers follow the files: one seed's final score moved changes the rendered claim
    p3 = panels["tier3"]
    p3["methods"]["flow_grpo@0.0005"]["final"][0] += 0.5
    assert page.render(panels) != open(os.path.join(ROOT, "docs", "results.md"), encoding="utf-8").read()


def test_results_page_statistics():
    """The one test behind every verdict (results_page.significance) against scipy.stats, the four comparisons the
    former fixed cut-off called "holds" at p > 0.05, a comparison without spread, a gain with the base's own error,
    the smallest detectable difference, and the verdict words over several cells."""
    import math
    import warnings

    from scipy import stats

    page = _results_page()
    # Welch's t, its Welch-Satterthwaite df and two-sided p: scipy's
    ref = stats.ttest_ind([1, 2, 3], [4, 5, 6.5], equal_var=False)
    r = page.significance([1, 2, 3], [4, 5, 6.5], better="lower")
    assert (r["t"], r["df"], r["p"]) == pytest.approx((ref.statistic, ref.df, ref.pvalue), rel=1e-12)
    assert r["word"] == "holds" and r["p"] < 0.05 and page.significance([1, 2, 3], [4, 5, 6.5])["word"] == "differs"
    assert page.significance([1, 2, 3], [4, 5, 6.5], better="higher")["word"] == "the opposite"
    assert page.welch_t([1, 2, 3], [4, 5, 6]) == pytest.approx(-3 / (2 / 3) ** 0.5, rel=1e-12)
    assert page.welch_t([1], [2, 3]) is None and page.significance([1], [2, 3])["word"] == "too few seeds"
    # one side without spread: Welch's df are the other side's n - 1, as scipy's
    r = page.significance([30, 30, 30], [20, 25, 40])
    t = (30 - statistics.mean([20, 25, 40])) / math.sqrt(statistics.variance([20, 25, 40]) / 3)
    assert r["df"] == pytest.approx(2.0) and r["p"] == pytest.approx(2 * stats.t.sf(t, 2), rel=1e-12)
    # no spread on either side: no test is defined (nothing divided by zero), whatever the difference
    for b in ([20, 20, 20], [30, 30, 30]):
        r = page.significance([30, 30, 30], b, better="higher")
        assert r["word"] == "no spread" and r["t"] is r["p"] is r["df"] is r["mdd"] is None and r["se"] == 0
    assert page.verdict([r]) == "no spread"
    # a gain over a base without error: the one-sample t at n - 1 df (scipy's); with the base's binomial error as a
    # second variance term (Welch's test against the base's n images): se^2 = s^2 / 3 + se_b^2,
    # df = se^4 / ((s^2 / 3)^2 / 2 + se_b^4 / (128 - 1))
    xs = [0.5, 0.6, 0.75]
    ref = stats.ttest_1samp(xs, 0.4)
    r = page.significance(xs, base=0.4)
    assert (r["t"], r["df"], r["p"]) == pytest.approx((ref.statistic, 2, ref.pvalue), rel=1e-12)
    se_b = page.binomial_se(0.4, 128)
    assert se_b == pytest.approx(math.sqrt(0.4 * 0.6 / 128)) and page.binomial_se(0.4, None) == 0
    v = statistics.variance(xs) / 3
    r = page.significance(xs, base=0.4, base_se=se_b, base_n=128, better="higher")
    df = (v + se_b ** 2) ** 2 / (v ** 2 / 2 + se_b ** 4 / 127)
    t = (statistics.mean(xs) - 0.4) / math.sqrt(v + se_b ** 2)
    assert (r["t"], r["df"], r["p"]) == pytest.approx((t, df, 2 * stats.t.sf(t, df)), rel=1e-12)
    assert t < ref.statistic and 2 < df < 127 and r["word"] == "within the noise"
    # seeds without spread against a base with an error: a normal test (infinite df), not "no spread"
    r = page.significance([0.6, 0.6, 0.6], base=0.4, base_se=0.05)
    assert math.isinf(r["df"]) and r["p"] == pytest.approx(2 * stats.norm.sf(4.0), rel=1e-12)
    assert page.significance([0.6, 0.6, 0.6], base=0.4, base_se=0.05, base_n=100)["df"] == pytest.approx(99)
    # the smallest detectable difference: 80% power at p < 0.05 (noncentral t at the test's se and df; normal at
    # infinite df: (z_0.975 + z_0.8) se)
    assert r["mdd"] == pytest.approx((stats.norm.ppf(0.975) + stats.norm.ppf(0.8)) * 0.05, rel=1e-9)
    r = page.significance([1, 2, 3], [4, 5, 6.5])
    crit, nc = stats.t.ppf(0.975, r["df"]), r["mdd"] / r["se"]
    assert stats.nct.sf(crit, r["df"], nc) + stats.nct.cdf(-crit, r["df"], nc) == pytest.approx(0.8, abs=1e-6)
    assert r["mdd"] > 2.9 * r["se"]  # 4 df: more than the normal formula's 2.8 se
    # the four comparisons the fixed cut-off 2.78 (Student's t at 4 df) called "holds": at their own df each has
    # p > 0.05; the page now calls each "within the noise"
    panels = {name: page.load_panel(name) for name in page.PANELS}
    b, t3 = panels["tier2b"], panels["tier3"]
    # (set B's Flow-GRPO row then had seeds 0-2; seeds 3-5, added since, make its gain hold: below)
    fg_b = b["methods"]["flow_grpo@0.001"]
    first3 = [x for x, seed in zip(fg_b["final"], fg_b["seeds"]) if seed < 3]
    gain_b = page.significance(first3, base=b["base"])  # the base taken as exact
    ref = stats.ttest_1samp(first3, b["base"])
    assert (gain_b["t"], gain_b["df"], gain_b["p"]) == pytest.approx((ref.statistic, 2, ref.pvalue), rel=1e-12)
    assert round(gain_b["t"], 1) == 3.2 and round(gain_b["p"], 3) == 0.084
    gain_b = page.significance(first3, base=b["base"], base_se=b["base_se"], base_n=b["base_n"])  # 128 images
    assert b["base_n"] == 128 and gain_b["word"] == "within the noise" and round(gain_b["p"], 3) == 0.059
    gain_b = page.gain(b, "flow_grpo@0.001", better="higher")
    assert fg_b["seeds"] == [0, 1, 2, 3, 4, 5] and gain_b["word"] == "holds" and round(gain_b["p"], 3) == 0.033
    gain_3 = page.significance(t3["methods"]["flow_grpo@0.0005"]["final"], base=t3["base"])
    assert round(gain_3["t"], 1) == 4.0 and gain_3["df"] == 2 and round(gain_3["p"], 3) == 0.057
    gain_3 = page.gain(t3, "flow_grpo@0.0005")
    assert t3["base_n"] == 100 and gain_3["word"] == "within the noise" and round(gain_3["p"], 3) == 0.191
    nft = panels["nft_cfg"]["methods"]
    raw = [nft[label]["steps_to_target_raw"] for label in ("diffusion_nft_cfg@0.0005", "flow_grpo@0.0005")]
    with warnings.catch_warnings():  # scipy warns of a side without spread (here DiffusionNFT's 30, 30, 30)
        warnings.simplefilter("ignore", RuntimeWarning)
        ref = stats.ttest_ind(*raw, equal_var=False)
    r = page.significance(*raw, better="lower")
    assert (r["t"], r["df"], r["p"]) == pytest.approx((ref.statistic, ref.df, ref.pvalue), rel=1e-12)
    assert round(r["t"], 1) == -4.0 and round(r["df"], 1) == 2.0 and round(r["p"], 3) == 0.057
    assert r["word"] == "within the noise"
    # (set B's 2-epoch KL row then had seeds 0-2; seeds 3-5, added since: p 0.057 at 6 seeds a side)
    kl3 = [[x for x, seed in zip(b["methods"][label]["kl_at_target"], b["methods"][label]["seeds"]) if seed < 3]
           for label in ("flow_dppo@0.001", "flow_grpo_2epochs@0.001")]
    kl = page.significance(*kl3, better="lower")
    ref = stats.ttest_ind(*kl3, equal_var=False)
    assert (kl["t"], kl["df"], kl["p"]) == pytest.approx((ref.statistic, ref.df, ref.pvalue), rel=1e-12)
    assert round(kl["t"], 1) == -3.0 and round(kl["df"], 1) == 2.3 and round(kl["p"], 3) == 0.082
    assert kl["word"] == "within the noise"
    verdicts = {(row[0], row[1]): row[-1] for row in page.claims(panels)}
    assert verdicts[("Flow-GRPO", "improves the base")] == "holds"  # 6 seeds on sets A and B
    assert verdicts[("Flow-GRPO", "improves held-out prompts (sharp base, lr 5e-4)")] == "within the noise"
    # (seeds 3-5 on set A, added since, make it hold there: p 0.008; set B's 3 seeds a side stay above)
    assert verdicts[("Flow-DPPO", "lower KL to the base at a matched score, 2 epochs each")] == \
        "holds on 1 of 2, within the noise elsewhere"
    assert verdicts[("DiffusionNFT", "with CFG, reaches the target in fewer iterations than Flow-GRPO, lr 0.0005")] \
        == "within the noise"
    # the verdict over several cells: each cell's own word
    up, down, level = (page.significance([4, 5, 6.5], [1, 2, 3], better="higher"),
                       page.significance([1, 2, 3], [4, 5, 6.5], better="higher"),
                       page.significance([1, 2, 3], [1.5, 2, 2.5], better="higher"))
    assert page.verdict([up, up]) == "holds" and page.verdict([up, level]) == \
        "holds on 1 of 2, within the noise elsewhere"
    assert page.verdict([down, level]) == "the opposite on 1 of 2"
    assert page.verdict([level, level]) == "within the noise"
    assert page.verdict([]) == "not measured yet"
    # per panel: a panel that cannot be compared never hides one that can (the T' measurement's Stepwise CPU row)
    machines = ("runs of different or unrecorded machines: CPU not compared", None)
    one_seed = ("418 (1 seed) vs 452 +- 56 (0.92x)", None)
    where = ("tier2", "tier2b")
    assert page.claim_verdict(where, [machines, one_seed],
                              "lower") == "not yet: set A machines differ; set B too few seeds"
    assert page.claim_verdict(where, [machines, ("400 +- 9 vs 452 +- 56", up)], "lower") == \
        "holds on set B (set A: machines differ)"
    assert page.claim_verdict(where, [one_seed, one_seed], "lower") == "too few seeds yet"
    assert page.claim_verdict(where, [machines, machines], "lower") == "not comparable yet (machines differ)"
    assert page.claim_verdict(where, [("a vs b", level), ("not measured yet", None)], "higher") == \
        "within the noise on set A (set B: not measured)"
    # the off-policy clip fraction: mean over the iterations that replayed (NaN / missing: none replayed)
    nan = float("nan")
    assert page.off_policy_clip({"iterations": [{"clip_frac_off_policy": 0.1}, {"clip_frac_off_policy": nan}, {},
                                                {"clip_frac_off_policy": 0.3}]}) == 0.2
    assert page.off_policy_clip({"iterations": [{}, {"clip_frac_off_policy": nan}]}) is None
    # the ablation table: Welch t against the described form; one seed gets no t and says so
    p = {"methods": {"op_grpo@0.001": {"seeds": [0, 1, 2], "final": [1, 2, 3], "kl": [0.1, 0.1, 0.1],
                                       "clip_off": [0.05, 0.07, 0.09]},
                     "op_grpo_per_step@0.001": {"seeds": [0, 1, 2], "final": [4, 5, 6], "kl": [0.2, 0.2, 0.2],
                                                "clip_off": [0.2, 0.2, 0.2]},
                     "op_grpo_share_50@0.001": {"seeds": [0], "final": [2], "kl": [0.3], "clip_off": [0.04]}}}
    rows = page.ablation_table(p)
    assert rows[2] == ("| described form (sequence weight) | 3 | 2.000 +- 1.000 | reference | 0.100 +- 0.000 | "
                       "7.0% +- 2.0% |")
    assert rows[3] == ("| per-step ratio | 3 | 5.000 +- 1.000 | t +3.7, df 4.0, p 0.021 | 0.200 +- 0.000 | "
                       "20.0% +- 0.0% |")  # scipy: ttest_ind([4, 5, 6], [1, 2, 3], equal_var=False)
    assert rows[4] == "| 50% replayed | 1 | 2.000 (1 seed) | n/a (one seed) | 0.300 (1 seed) | 4.0% |"
    assert len(rows) == 5
    # a target field where a seed never reached the target gets no t (its failures would be dropped), and says so
    p = {"methods": {"a": {"steps_to_target": [40, 40, 40]}, "b": {"steps_to_target": [30, 30, None]}}}
    text, r = page.cell(p, "a", "b", "steps_to_target")
    assert r is None and text.endswith("seeds reaching it 3/3 vs 2/3; not tested (a seed never reached it)")
    assert page.claim_verdict(("tier2",), [(text, r)], "lower") == "not tested (a seed never reached the target)"
    # its detectable difference counts the seed that never reached it at its run's end (60), marked +: Welch's se of
    # [40, 40, 40] against [30, 30, 60] is 10.0 at df 2.0, and 80% power at p < 0.05 needs 5.65 se there
    p["methods"]["a"]["run_end"] = {"steps_to_target": [60.0] * 3}
    p["methods"]["b"]["run_end"] = {"steps_to_target": [60.0] * 3}
    assert page.censored_detectable(p, "a", "b", "steps_to_target") == "57 iterations+ (3 vs 3 seeds)"
    assert page.significance([40, 40, 40], [30, 30, 60])["mdd"] == pytest.approx(56.5, abs=0.1)
    assert page.censored_detectable(p, "a", "b", "final") is None
    p["methods"]["b"]["steps_to_target"] = [30, 30, 20]
    assert page.censored_detectable(p, "a", "b", "steps_to_target") is None  # nothing censored: the t test has it
    text, r = page.cell(p, "a", "b", "steps_to_target", "lower")
    assert r["word"] == "within the noise" and ", t +4.0, df 2.0, p 0.057, seeds reaching it 3/3 vs 3/3" in text
    # every seed of both sides at the same evaluation: no test, said so, and no detectable difference claimed
    p["methods"]["b"]["steps_to_target"] = [30, 30, 30]
    text, r = page.cell(p, "a", "b", "steps_to_target", "lower")
    assert "no spread" in text and r["word"] == "no spread" and page.detectable_text(r, "steps_to_target") is None
    assert page.claim_verdict(("tier2",), [(text, r)], "lower") == "no spread"
    # clip fractions print as percentages in the claim cells too, as the paper gives them
    assert page.fmt((0.249, 0.006), percent=True) == "24.9% +- 0.6%"
    assert page.fmt((0.042, None), percent=True) == "4.2% (1 seed)"


def test_results_page_panel_from_two_folders(tmp_path):
    """A panel may take the runs its folder lacks from another folder (``extra``) and that folder's target
    (``target_from``): DiffusionNFT without CFG against Flow-GRPO with CFG, to Flow-GRPO's absolute target. Its own
    base stays its folder's; a folder scoring another split or score is refused by name."""
    page = _results_page()

    def run(method, seed, ys, split="trained"):
        return {"method": method, "seed": seed, "cpu_s": 60.0, "iterations": [{}] * 6,
                "machine": {"calibration_s": 0.15},
                "evals": [{"step": 10 * i, "cpu_s": 10.0 * i, "kl": 0.01 * i,
                           split: {"overall": {"strict": y, "n": 100}}} for i, y in enumerate(ys)]}

    def folder(name, base, target, runs, split="trained"):
        os.makedirs(tmp_path / name)
        with open(tmp_path / name / "results.json", "w") as f:
            json.dump(
                {"summary": {"split": split, "score_key": "strict", "target": target, "base": base}, "runs": runs}, f)

    folder("nft", 0.1, None, [run("diffusion_nft@0.001", s, [0.1, 0.3, 0.5]) for s in (0, 1)])
    folder("fg", 0.25, 0.4, [run("flow_grpo@0.001", s, [0.25, 0.35, 0.45]) for s in (0, 1)]
           + [run("diffusion_nft@0.001", 9, [0.0, 0.0, 0.0])])  # a label the first folder has: never taken from here
    page.RESULTS = str(tmp_path)
    page.PANELS = {"p": dict(folder="nft", extra="fg", target_from="fg",
                             methods={"diffusion_nft@0.001": "NFT", "flow_grpo@0.001": "FG"})}
    p = page.load_panel("p")
    assert p["base"] == 0.1 and p["target"] == 0.4
    # the base's error: its own folder's step-0 evaluation, 100 images
    assert p["base_n"] == 100 and p["base_se"] == pytest.approx((0.1 * 0.9 / 100) ** 0.5)
    assert p["methods"]["diffusion_nft@0.001"]["seeds"] == [0, 1]
    assert p["methods"]["flow_grpo@0.001"]["seeds"] == [0, 1]
    # iterations to the target: the first evaluation reaching it, and the crossing interpolated between the two
    # evaluations around it (0.3 at 10, 0.5 at 20: 0.4 at 15; 0.35 at 10, 0.45 at 20: also 15)
    assert p["methods"]["diffusion_nft@0.001"]["steps_to_target_raw"] == [20, 20]
    assert p["methods"]["flow_grpo@0.001"]["steps_to_target_raw"] == [20, 20]
    assert p["methods"]["diffusion_nft@0.001"]["steps_to_target"] == pytest.approx([15, 15])
    assert p["methods"]["flow_grpo@0.001"]["steps_to_target"] == pytest.approx([15, 15])
    # no run of these folders records its code: the panel names both folders (whose commits the page then lists)
    assert p["without_code"] == ["fg", "nft"]
    # later seeds of the same labels (``seeds_from``): only the seeds the panel lacks, and the panel keeps its target
    folder("more", 0.1, 0.9, [run("flow_grpo@0.001", s, [0.25, 0.3, 0.6]) for s in (1, 2)])
    page.PANELS["p"]["seeds_from"] = ("more",)
    p = page.load_panel("p")
    assert p["methods"]["flow_grpo@0.001"]["seeds"] == [0, 1, 2] and p["target"] == 0.4
    assert p["methods"]["flow_grpo@0.001"]["final"] == [0.45, 0.45, 0.6]
    assert p["methods"]["diffusion_nft@0.001"]["seeds"] == [0, 1]
    assert "further seeds from `benchmarks/results/more/`" in page.folders_note(page.PANELS["p"])
    folder("more_val", 0.1, 0.9, [run("flow_grpo@0.001", 3, [0.25, 0.3, 0.6], split="val")], split="val")
    page.PANELS["p"]["seeds_from"] = ("more_val",)
    with pytest.raises(ValueError, match="more_val"):
        page.load_panel("p")
    del page.PANELS["p"]["seeds_from"]
    folder("val", 0.25, 0.4, [], split="val")
    page.PANELS["p"]["extra"] = page.PANELS["p"]["target_from"] = "val"
    with pytest.raises(ValueError, match="val"):
        page.load_panel("p")

def test_readme_tier2_numbers_are_the_committed_summary():
    """docs/history.md's tier-2 Flow-GRPO numbers (the README's former summary, kept there, the former opening of its
    shapes section and the tier-2 section) are those of benchmarks/results/shapes_tier2/summary.json (rebuilt by
    `python benchmarks/shapes.py --tier 2 --methods flow_grpo`), and that summary passes the tier's acceptance. The
    README's own table is checked by test_results_page_and_readme_table_are_the_committed_results."""
    summary = _committed_summary("shapes_tier2")
    fg = summary["methods"]["flow_grpo"]
    quoted = f"{summary['base']:.3f} to {fg['final_mean']:.3f} +- {fg['final_std']:.3f}"
    text, readme = _page_text(HISTORY), _former_readme_summary()
    assert quoted in readme, f"docs/history.md, the README's former summary: the tier-2 numbers '{quoted}'"
    shapes = text[text.index("## Shapes"):]
    assert quoted in shapes[:shapes.index("### ")], f"docs/history.md, Shapes: the tier-2 numbers '{quoted}'"
    gain = fg["final_mean"] - summary["base"]
    assert (f"{fg['final_mean']:.3f} +- {fg['final_std']:.3f} (mean +- std over the 3 seeds) against the base's "
            f"{summary['base']:.3f}: {gain:+.3f}") in text, "docs/history.md, tier 2: the acceptance runs"
    assert len(fg["seeds"]) >= 3 and all(v for k, v in summary["acceptance"].items() if k.endswith("_ok"))
    assert summary["acceptance"]["gain_at_least_3_std"] and summary["acceptance"]["training_reward_rises"]
    # the other methods' 3-seed numbers quoted beside it are those of the lr-1e-3 runs of the sweep folder
    sweep = _committed_summary("shapes_tier2_lr")["methods"]
    for label, name in (("flow_dppo@0.001", "Flow-DPPO"), ("op_grpo@0.001", "OP-GRPO")):
        s = sweep[label]
        assert len(s["seeds"]) == 3 and f"{name} " in readme, label
        assert f"{s['final_mean']:.3f} +- {s['final_std']:.3f}" in readme, f"README.md: {label}'s committed numbers"
    # and the tier-3 (held-out) Flow-GRPO numbers are those of its committed summary, with its seed count
    tier3 = _committed_summary("shapes_tier3")
    s = tier3["methods"]["flow_grpo@0.001"]
    assert len(s["seeds"]) >= 3 and tier3["tier"] == 3
    quoted = f"{tier3['base']:.3f} -> {s['final_mean']:.3f} +- {s['final_std']:.3f}"
    assert quoted in readme, f"README.md: tier 3's committed numbers ({quoted})"
    assert f"{quoted} on 100 val images at {len(s['seeds'])} seeds" in readme, "README.md: tier 3's seed count"
    # and the 100-iteration Flow-DPPO numbers are those of benchmarks/results/shapes_tier3_long/, on both pages
    long = _committed_summary("shapes_tier3_long")
    s = long["methods"]["flow_dppo@0.001"]
    assert long["tier"] == 3 and len(s["seeds"]) >= 3
    quoted = f"{long['base']:.3f} -> {s['final_mean']:.3f} +- {s['final_std']:.3f} at {len(s['seeds'])} seeds"
    assert quoted in readme, f"README.md: the 100-iteration tier-3 numbers ({quoted})"
    assert f"**{s['final_mean']:.3f} +- {s['final_std']:.3f}**" in text


def test_readme_sentence_changes_with_the_file():
    quickstart, scores = _quickstart()
    before = scores["trained_prompts"]["before"]["overall"]["strict"]
    scores["trained_prompts"]["after"]["overall"]["strict"] = 0.9
    assert f"{before:.3f} -> 0.900" in quickstart.readme_summary(scores)
    with open(QUICKSTART_SEEDS, encoding="utf-8") as f:
        seeds = json.load(f)
    seeds["gains"]["trained_prompts/strict"]["min"] = -0.5
    assert "range -0.500 to" in quickstart.readme_seeds_summary(seeds)


def test_shipped_reward_names_in_readme_and_docs_are_the_registered_ones():
    """One name per reward in README, docs and CLI: every `shapes_*` / `jpeg_*` name quoted in the pages is a
    registered name (what --reward_funcs and get_reward accept and what the log calls it) or a `module:attr`."""
    from trl_flow.cli import shipped
    from trl_flow.rewards import available_rewards, get_reward

    names = set(available_rewards())
    recipes = set(shipped("recipes"))
    for page in PAGES:
        text = open(page, encoding="utf-8").read()
        for m in re.finditer(r"`((?:[\w.]+:)?(?:shapes|jpeg)_\w+)`", text):
            token = m.group(1)
            if token in recipes:
                continue
            if ":" in token:
                get_reward(token)
            else:
                assert token in names, f"{_rel(page)}: `{token}` is not a reward name; use one of {sorted(names)}"
                assert getattr(get_reward(token), "__name__", token) == token  # logged under the same name


def update_tables() -> None:
    for page in PAGES:
        text = open(page, encoding="utf-8").read()

        def fill(m):
            cls = _table_class(m.group(2))
            return m.group(0) if cls is None else m.group(1) + config_table(cls) + m.group(4)

        new = TABLE.sub(fill, text)
        if new != text:
            with open(page, "w", encoding="utf-8") as f:
                f.write(new)
            print("updated", _rel(page))


if __name__ == "__main__":
    if sys.argv[1:] == ["--update"]:
        sys.path.insert(0, ROOT)
        update_tables()
    else:
        print(__doc__)


def test_history_quotes_the_committed_learning_rate_range():
    """docs/history.md's 3-seed lr-2e-3 numbers (the stability claim) are those of the committed sweep summary."""
    sweep = _committed_summary("shapes_tier2_lr")["methods"]
    text = _page_text(HISTORY)
    three_seeds = ("flow_grpo@0.002", "flow_dppo@0.002", "flow_dppo@0.001", "flow_grpo@0.001", "op_grpo@0.002",
                   "stepwise@0.001", "op_grpo_per_step@0.001", "op_grpo_no_correction@0.001",
                   "op_grpo_no_truncation@0.001", "op_grpo_share_100@0.001", "stepwise_per_step@0.001",
                   "stepwise_t1@0.001")
    for label in three_seeds:
        s = sweep[label]
        assert len(s["seeds"]) == 3, label
        assert f"{s['final_mean']:.3f} +- {s['final_std']:.3f}" in text, f"docs/history.md: {label}'s final score"
    for label in ("flow_grpo@0.002", "flow_dppo@0.002", "op_grpo@0.002", "stepwise@0.001"):
        val = sweep[label]["final_by_split"]["val"]["strict"]
        assert f"{val[0]:.3f} +- {val[1]:.3f}" in text, f"docs/history.md: {label}'s val score"


def test_history_quotes_the_committed_replay_share_runs():
    """The G = 4 (25% replayed) comparison in docs/history.md is the committed summary's, at 3 seeds each."""
    summary = _committed_summary("shapes_tier2_g4")
    text = _page_text(HISTORY)
    assert f"= {summary['target']:.3f}." in text, "docs/history.md: the G = 4 target"
    for label in ("flow_grpo_g4@0.00025", "op_grpo_g4_share_100@0.00025", "flow_grpo_g4@0.0005",
                  "op_grpo_g4_share_100@0.0005"):
        s = summary["methods"][label]
        assert len(s["seeds"]) == 3, label
        assert f"{s['final_mean']:.3f} +- {s['final_std']:.3f}" in text, f"docs/history.md: {label}'s final score"


def test_sharp_base_numbers_are_the_committed_summary():
    """The tier-3 sharp-base numbers in docs/history.md (its table and the README's former summary) are
    benchmarks/results/shapes_tier3_sharp/'s (every row at 3 seeds), and the lr-5e-4 Flow-GRPO gain the former summary
    quotes is beyond 3 standard errors of the seeds (the base taken as exact); with the base's own error it is not,
    and the notebook quotes that test's numbers."""
    summary = _committed_summary("shapes_tier3_sharp")
    assert summary["tier"] == 3
    readme, bench = _former_readme_summary(), _page_text(HISTORY)
    for label, s in summary["methods"].items():
        assert len(s["seeds"]) == 3, label
        assert f"**{s['final_mean']:.3f} +- {s['final_std']:.3f}**" in bench, f"docs/history.md: {label}"
    fg = summary["methods"]["flow_grpo@0.0005"]
    assert f"{summary['base']:.3f} -> {fg['final_mean']:.3f} +- {fg['final_std']:.3f} on val at 3 seeds" in readme
    gains = [v - summary["base"] for v in fg["final_per_seed"]]
    assert min(gains) > 0 and (sum(gains) / 3) / (fg["final_std"] / 3 ** 0.5) > 3
    # the notebook's correction: the results page's test of the same gain, with the base's binomial error
    page = _results_page()
    r = page.gain(page.load_panel("tier3"), "flow_grpo@0.0005")
    assert r["word"] == "within the noise"
    assert f"the final gain is within the noise: {page.stat_text(r)}.)" in bench


def test_flow_dppo_matched_numbers_are_the_committed_runs():
    """docs/flow_dppo.md's matched-update statements are what the committed tier-2 runs give (results_page's
    statistics on benchmarks/results/shapes_tier2_matched)."""
    page = _results_page()
    p = page.load_panel("tier2")
    text = _page_text(os.path.join("docs", "flow_dppo.md"))
    one = page.compare(p, "flow_dppo_1epoch@0.001", "flow_grpo@0.001")
    two = page.compare(p, "flow_dppo@0.001", "flow_grpo_2epochs@0.001")
    epoch = page.compare(p, "flow_grpo_2epochs@0.001", "flow_grpo@0.001")
    one_b = page.compare(page.load_panel("tier2b"), "flow_dppo_1epoch@0.001", "flow_grpo@0.001")
    # the KL at a matched score with one pass: on each set a Flow-GRPO seed of six never reached the score: no t
    kl = page.compare(page.load_panel("tier2b"), "flow_dppo_1epoch@0.001", "flow_grpo@0.001", "kl_at_target")
    kl_a = page.compare(p, "flow_dppo_1epoch@0.001", "flow_grpo@0.001", "kl_at_target")
    assert min(one["na"], one["nb"], one_b["na"], one_b["nb"]) == 6 and min(two["na"], two["nb"]) == 6
    assert f"Welch t {one['t']:.1f}; on prompt set B t {one_b['t']:.1f}" in text
    assert f"6 seeds a side detect about {max(one['test']['mdd'], one_b['test']['mdd']):.2f}" in text
    assert f"(t {two['t']:.1f}, 6 seeds a side detect about {two['test']['mdd']:.2f};" in text
    assert f"(t {epoch['t']:.1f})" in text
    assert (kl["na"], kl["nb"], kl_a["na"], kl_a["nb"]) == (6, 5, 6, 5)
    assert f"{kl['ratio']:.2f}x Flow-GRPO's on prompt set B and {kl_a['ratio']:.2f}x on set A, and untested" in text
    assert f"Welch p {kl['test']['p']:.3f} and {kl_a['test']['p']:.3f})" in text
    # the words: results_page.significance's, and the page's verdict for the KL row
    assert one["test"]["word"] == one_b["test"]["word"] == two["test"]["word"] == "within the noise"
    verdicts = {(row[0], row[1]): row[-1] for row in page.claims({n: page.load_panel(n) for n in page.PANELS})}
    assert verdicts[("Flow-DPPO", "lower KL to the base at a matched score, 1 epoch each")] == \
        "not tested (a seed never reached the target)"
    # two passes each on set B (the runs set B lacked until stop 49), and the KL at a matched score with two passes
    two_b = page.compare(page.load_panel("tier2b"), "flow_dppo@0.001", "flow_grpo_2epochs@0.001")
    assert f"on prompt set B too, t {two_b['t']:.1f})" in text and min(two_b["na"], two_b["nb"]) == 6
    assert two_b["test"]["word"] == "within the noise"
    assert "6 seeds a side, one pass each and two passes each)" in text
    kl2_b, kl2_a = [page.compare(q, "flow_dppo@0.001", "flow_grpo_2epochs@0.001", "kl_at_target", "lower")
                    for q in (page.load_panel("tier2b"), p)]
    assert (f"With two passes each it is {kl2_a['ratio']:.2f}x on set A, where the difference holds at 6 seeds a side "
            f"({page.stat_text(kl2_a['test'])};") in text
    assert (f"and {kl2_b['ratio']:.2f}x on set B, within the noise at 6 seeds a side too "
            f"({page.stat_text(kl2_b['test'])};") in text
    assert (kl2_a["test"]["word"], kl2_b["test"]["word"]) == ("holds", "within the noise")
    assert min(kl2_a["na"], kl2_a["nb"], kl2_b["na"], kl2_b["nb"]) == 6


def test_stepwise_grid_numbers_are_the_committed_measurement():
    """docs/stepwise_flow_grpo.md's grid comparison quotes benchmarks/results/stepwise_grid_seed{0,1}.json (paired
    differences shifted - linear, and the correlation per T')."""
    docs = " ".join(open(os.path.join(ROOT, "docs", "stepwise_flow_grpo.md")).read().split())
    runs = [
        json.load(open(os.path.join(ROOT, "benchmarks", "results", f"stepwise_grid_seed{s}.json"))) for s in (0, 1)]
    paired = [{p["substeps"]: p for p in r["paired"]} for r in runs]

    def pm(d):
        return f"{d['diff']:+.3f} +- {d['se']:.3f}"

    assert f"at T' = 2 ({pm(paired[0][2]['corr_final'])} and {pm(paired[1][2]['corr_final'])} on seeds 0 and 1" in docs
    assert f"T' = 3 ({pm(paired[0][3]['corr_final'])}, {pm(paired[1][3]['corr_final'])})" in docs
    assert f"T' = 5 ({pm(paired[0][5]['corr_final'])}, {pm(paired[1][5]['corr_final'])})" in docs
    assert f"differences {pm(paired[0][2]['gain_corr'])} / {pm(paired[1][2]['gain_corr'])} at T' = 2" in docs
    worst = max(abs(p[t]["gain_corr"]["diff"]) for p in paired for t in (2, 3, 5))
    assert worst <= 0.024 + 5e-4
    lin = {r["substeps"]: r["corr_final"] for r in runs[0]["rows"] if r["grid"] == "linear"}
    assert " / ".join(f"{lin[t]:.3f}" for t in (2, 3, 5, 20)) + " at T' = 2 / 3 / 5 / 20" in docs


def _op_described_form_rows(folder: str, cpu: bool) -> list[tuple[str, dict, dict]]:
    """docs/op_grpo.md's described-form table rows from benchmarks/results/<folder>/summary.json, per rate: final
    score and Welch t, iterations to the target (and, with ``cpu``, CPU-seconds to it: runs of one machine), KL to
    the base and its t, off-policy clip fraction. Returns (row, results_page.significance of the final score, of
    the per-seed final KL) per rate."""
    import math
    import statistics as st

    page = _results_page()
    welch_t = page.welch_t
    d = json.load(open(os.path.join(ROOT, "benchmarks", "results", folder, "summary.json")))
    panel = page.load_panel({"shapes_tier2_op": "tier2op", "shapes_sparse": "sparse"}[folder])
    assert not cpu or d["cpu_comparable"]
    out = []
    for lr in ("0.0005", "0.001", "0.002"):
        o, f = d["methods"][f"op_grpo@{lr}"], d["methods"][f"flow_grpo@{lr}"]
        assert len(o["seeds"]) >= 3 and len(f["seeds"]) >= 3, (folder, lr)
        a, b = o["final_per_seed"], f["final_per_seed"]
        t = welch_t(a, b)
        so = [x for x in o["steps_to_target_per_seed"] if x is not None]
        sf = [x for x in f["steps_to_target_per_seed"] if x is not None]
        co = [x for x in o["cpu_to_target_per_seed"] if x is not None]
        cf = [x for x in f["cpu_to_target_per_seed"] if x is not None]
        ko, kf = o["kl_final_ms"], f["kl_final_ms"]
        tk = (ko[0] - kf[0]) / math.sqrt(ko[1] ** 2 / len(o["seeds"]) + kf[1] ** 2 / len(f["seeds"]))
        reached = f"seeds reaching it {len(so)}/{len(o['seeds'])} vs {len(sf)}/{len(f['seeds'])}"
        steps = (f"{st.mean(so):.0f} vs {st.mean(sf):.0f} ({st.mean(so) / st.mean(sf):.2f}x; {reached})" if so and sf
                 else f"not compared ({reached})")
        cpu_cell = ""
        if cpu:
            cpu_cell = (f" {st.mean(co):.0f} vs {st.mean(cf):.0f} ({st.mean(co) / st.mean(cf):.2f}x) |" if co and cf
                        else " not compared |")
        row = (f"| {float(lr):g} | {o['final_mean']:.3f} +- {o['final_std']:.3f} vs {f['final_mean']:.3f} +- "
               f"{f['final_std']:.3f} (t {t:+.1f}) | {steps} |{cpu_cell} {ko[0]:.3f} vs {kf[0]:.3f} "
               f"({ko[0] / kf[0]:.2f}x, t {tk:+.1f}) | {100 * o['clip_frac_off_policy'][0]:.1f}% |")
        kl = [panel["methods"][f"{m}@{lr}"]["kl"] for m in ("op_grpo", "flow_grpo")]
        assert [statistics.mean(x) for x in kl] == pytest.approx([ko[0], kf[0]], rel=1e-12)
        r_kl = page.significance(*kl, better="lower")
        assert r_kl["t"] == pytest.approx(tk, rel=1e-12)
        out.append((row, page.significance(a, b), r_kl))
    return out


def test_op_grpo_described_form_table_is_the_committed_summary():
    """docs/op_grpo.md's described-form table (tier 2, three rates) is benchmarks/results/shapes_tier2_op/summary.json:
    final score and Welch t, iterations to the target, KL to the base and its t, off-policy clip fraction (the
    replay-share change)."""
    docs = open(os.path.join(ROOT, "docs", "op_grpo.md")).read()
    for row, r, r_kl in _op_described_form_rows("shapes_tier2_op", cpu=False):
        assert row in docs, row
        assert r["word"] == "within the noise", "the doc says the final scores do not separate"
        assert r_kl["word"] == "holds", "the doc says the KL is lower at every rate"


def test_op_grpo_sparse_tier_table_is_the_committed_summary():
    """docs/op_grpo.md's sparse-tier table and its reading (the replay-share change) are
    benchmarks/results/shapes_sparse/summary.json: the rows (with CPU-seconds to the target: one machine), the target
    and Flow-GRPO's gain, the cost per iteration."""
    import statistics as st

    docs = open(os.path.join(ROOT, "docs", "op_grpo.md")).read()
    flat = " ".join(docs.split())
    for row, r, r_kl in _op_described_form_rows("shapes_sparse", cpu=True):
        assert row in docs, row
        assert r["word"] == "within the noise", "the doc says the final scores do not separate"
        assert r_kl["word"] == "holds", "the doc says the KL is lower at every rate"
    d = json.load(open(os.path.join(ROOT, "benchmarks", "results", "shapes_sparse", "summary.json")))
    gain = d["methods"]["flow_grpo@0.001"]["final_mean"] - d["base"]
    assert f"gains only +{gain:.3f}" in flat and f"is {d['target']:.3f}, about" in flat
    cost = {m: st.mean(d["methods"][f"{m}@{lr}"]["cpu_s_per_iter"][0] for lr in ("0.0005", "0.001", "0.002"))
            for m in ("op_grpo", "flow_grpo")}
    assert (f"costs {cost['op_grpo'] / cost['flow_grpo']:.2f}x a Flow-GRPO one ({cost['op_grpo']:.1f} against "
            f"{cost['flow_grpo']:.1f} CPU-s") in flat


def test_stepwise_substeps_table_is_the_committed_summaries():
    """docs/stepwise_flow_grpo.md's T' table (the T' measurement: the default T' = 2 rests on it) quotes tier 2's
    committed summaries: final strict and Welch t against Flow-GRPO on sets A and B (3 seeds a row), CPU per iteration
    and CPU to the target against Flow-GRPO's on set B (one machine), and no row separates from Flow-GRPO or T' = 5."""
    from trl_flow import StepwiseFlowGRPOConfig

    docs = open(os.path.join(ROOT, "docs", "stepwise_flow_grpo.md")).read()
    res = os.path.join(ROOT, "benchmarks", "results")
    a = json.load(open(os.path.join(res, "shapes_tier2_matched", "summary.json")))["methods"]
    b_sum = json.load(open(os.path.join(res, "shapes_tier2b", "summary.json")))
    b = b_sum["methods"]
    assert b_sum["cpu_comparable"]

    page = _results_page()
    t = page.welch_t

    def final(d, label):
        m = d.get(label)
        if m is None:
            return "not run"
        assert len(m["seeds"]) >= 3, label
        return (f"{m['final_mean']:.3f} +- {m['final_std']:.3f}" + ("" if label == "flow_grpo@0.001" else
                f" (t {t(m['final_per_seed'], d['flow_grpo@0.001']['final_per_seed']):+.1f})"))

    fg_cpu = b["flow_grpo@0.001"]["cpu_s_per_iter"][0]
    for name, label in (("Flow-GRPO", "flow_grpo@0.001"), ("T' = 2", "stepwise_t2@0.001"),
                        ("T' = 3", "stepwise_t3@0.001"), ("T' = 5", "stepwise@0.001")):
        cpu = (f"{b[label]['cpu_s_per_iter'][0] / fg_cpu:.2f}x | {b[label]['cpu_to_target']:.2f}x"
               if label in b else "not run | not run")
        row = f"| {name} | {final(a, label)} | {final(b, label)} | {cpu} |"
        assert row in docs, row
        for d in (a, b):
            if label in d and label != "flow_grpo@0.001":
                r = page.significance(d[label]["final_per_seed"], d["flow_grpo@0.001"]["final_per_seed"])
                assert r["word"] == "within the noise", label
    t52 = t(a["stepwise@0.001"]["final_per_seed"], a["stepwise_t2@0.001"]["final_per_seed"])
    # T' = 1 (the sweep folder's runs) against T' = 5 on set A: below it, within the noise
    sweep = json.load(open(os.path.join(res, "shapes_tier2_lr", "summary.json")))["methods"]
    one, five = (sweep[label] for label in ("stepwise_t1@0.001", "stepwise@0.001"))
    r = page.significance(one["final_per_seed"], five["final_per_seed"], better="lower")
    assert r["word"] == "within the noise" and r["t"] < 0
    assert (f"({one['final_mean']:.3f} +- {one['final_std']:.3f} against {five['final_mean']:.3f} +- "
            f"{five['final_std']:.3f}, {page.stat_text(r)})") in " ".join(docs.split())
    assert f"T' = 5 against T' = 2 on set A: t {t52:+.1f}" in docs
    assert page.significance(a["stepwise@0.001"]["final_per_seed"], a["stepwise_t2@0.001"]["final_per_seed"])[
        "word"] == "within the noise"
    assert StepwiseFlowGRPOConfig().num_substeps == 2


def test_sparse_tier_gains_in_benchmarks_md_are_the_committed_summary():
    """docs/history.md's sparse-tier comparison: each method's gain over the base per rate, mean +- std over 3 seeds
    with its one-sample t, from benchmarks/results/shapes_sparse/summary.json; the acceptance bars it quotes (gain and
    seed spread) are the summary's, and the summary fails them as the notebook says."""
    import math
    import statistics as st

    flat = _page_text(HISTORY)
    d = json.load(open(os.path.join(ROOT, "benchmarks", "results", "shapes_sparse", "summary.json")))
    for m in ("flow_grpo", "op_grpo"):
        for lr in ("0.0005", "0.001", "0.002"):
            g = [x - d["base"] for x in d["methods"][f"{m}@{lr}"]["final_per_seed"]]
            assert len(g) >= 3
            t = st.mean(g) / (st.stdev(g) / math.sqrt(len(g)))
            assert f"+{st.mean(g):.3f} +- {st.stdev(g):.3f} (t {t:.1f})" in flat, (m, lr)
    acc = d["acceptance"]
    assert acc["gain_ok"] is False and acc["gain_at_least_3_std"] is False
    import importlib.util

    spec = importlib.util.spec_from_file_location("docs_bench_shapes", os.path.join(ROOT, "benchmarks", "shapes.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert acc["required_gain"] == bench.ACCEPT_GAIN_SPARSE
    assert f"misses both the +{acc['required_gain']:.2f} and the {bench.ACCEPT_STDS:g}-std bar" in flat


def test_readme_op_grpo_verdict_is_the_committed_summaries():
    """README's OP-GRPO sentence (the replay-share change): the KL range over both tiers and three rates, and no final
    score separating, from shapes_tier2_op and shapes_sparse."""
    flat = " ".join(open(os.path.join(ROOT, "README.md")).read().split())
    ratios = []
    for folder, cpu in (("shapes_tier2_op", False), ("shapes_sparse", True)):
        d = json.load(open(os.path.join(ROOT, "benchmarks", "results", folder, "summary.json")))["methods"]
        for lr in ("0.0005", "0.001", "0.002"):
            ratios.append(d[f"op_grpo@{lr}"]["kl_final_ms"][0] / d[f"flow_grpo@{lr}"]["kl_final_ms"][0])
        assert all(r["word"] == "within the noise" for _, r, _ in _op_described_form_rows(folder, cpu))
    assert f"ends at {min(ratios):.2f}-{max(ratios):.2f}x Flow-GRPO's KL to the base" in flat


def test_op_grpo_ablation_tables_are_the_committed_summaries():
    """docs/op_grpo.md's two ablation tables (the replay-share change: tier 2 set A and the sparse tier, lr 1e-3) are
    results_page.ablation_table of the committed results, row for row: every committed ablation, its seeds, final
    strict, Welch t against the described form, KL to the base and off-policy clip fraction; the sentences quoting
    the per-step ratio's clip multiple are the committed means; the ablations whose final score separates are named
    in docs/op_grpo.md and README.md."""
    import statistics as st

    rp = _results_page()
    docs = open(os.path.join(ROOT, "docs", "op_grpo.md")).read()
    flat = " ".join(docs.split())
    separated = {}  # "<row> (<panel>, t <t>)" -> t, for every ablation whose final score separates
    panels = {}
    for panel, heading in (("tier2op_ablations", "**The described ablations on tier 2, prompt set A**"),
                           ("sparse_ablations", "**The described ablations on the sparse tier**")):
        p = panels[panel] = rp.load_panel(panel)
        table = rp.ablation_table(p)
        assert "op_grpo@0.001" in p["methods"] and heading in docs, panel
        after = docs.split(heading, 1)[1]
        assert "\n".join(table) in after.split("\n\n**", 1)[0], f"{panel}: the table is not the committed one"
        seeds = {len(p["methods"][label]["seeds"]) for label in rp.ABLATION_ROWS if label in p["methods"]}
        if seeds != {3}:  # a table with fewer seeds on some row says so in its heading
            assert "seeds so far" in after.split("\n", 1)[0], panel
        # the prose names every ablation whose final score separates from the described form's (results_page's
        # significance, p < 0.05), as "<row> (<panel>, t <t>, df <df>, p <p>)", and says none does only when none does
        tests = {label: rp.significance(p["methods"][label]["final"], p["methods"]["op_grpo@0.001"]["final"])
                 for label in rp.ABLATION_ROWS if label in p["methods"] and label != "op_grpo@0.001"}
        apart = {label: r for label, r in tests.items() if r["p"] is not None and r["p"] < 0.05}
        for label, r in apart.items():
            quoted = f"{rp.ABLATION_ROWS[label]} ({rp.SHORT[panel]}, {rp.stat_text(r)})"
            separated[quoted] = t = r["t"]
            assert quoted in flat, (panel, label, t)
        quote = f"as often as the sequence weight ({rp.SHORT[panel]})"
        if "op_grpo_per_step@0.001" not in p["methods"]:
            assert quote not in flat, f"{panel}: the per-step ratio is quoted but not committed"
            continue
        clip = {
            label: st.mean(p["methods"][label]["clip_off"]) for label in ("op_grpo@0.001", "op_grpo_per_step@0.001")}
        ratio = clip["op_grpo_per_step@0.001"] / clip["op_grpo@0.001"]
        assert f"clips {ratio:.1f}x {quote}" in flat, (panel, ratio)
    # the share sentences: on both tiers no share separates (set A's final means and the 50% share's t as quoted); on
    # the sparse tier KL and clip fraction fall as the replayed share grows; set A's clip fractions and KL as quoted
    labels = ("op_grpo_share_12@0.001", "op_grpo@0.001", "op_grpo_share_50@0.001")
    assert not [q for q in separated if q.startswith(("12.5% replayed", "50% replayed"))]
    a = panels["tier2op_ablations"]["methods"]
    t50 = rp.welch_t(a["op_grpo_share_50@0.001"]["final"], a["op_grpo@0.001"]["final"])
    finals = ", ".join(f"{st.mean(a[label]['final']):.3f}" for label in labels)
    assert f"(set A: {finals}; the 50% share t {t50:+.1f})" in flat, finals
    m = panels["sparse_ablations"]["methods"]
    shares = [m[label] for label in labels]
    assert all(len(x["seeds"]) == 3 for x in shares)
    for field in ("kl", "clip_off"):
        means = [st.mean(x[field]) for x in shares]
        assert means[0] > means[1] > means[2], (field, means)
    clip = ", ".join(f"{100 * st.mean(a[label]['clip_off']):.1f}%" for label in labels)
    kl = ", ".join(f"{st.mean(a[label]['kl']):.3f}" for label in labels)
    assert f"on set A the clip fraction falls the same way ({clip})" in flat, clip
    assert f"the KL falls from 12.5% to 25% and then stays ({kl})" in flat, kl
    none = "No ablation's final score separates from the described form's (every p in the tables is at least 0.05"
    assert (none in flat) == (not separated), separated
    # the README's sentence: the separating ablations by the same words, and "not below" only when none is below
    readme = " ".join(open(os.path.join(ROOT, "README.md")).read().split())
    for quoted, t in separated.items():
        assert quoted in readme, quoted
    assert ("do not end below it on either tier" in readme) == all(t > 0 for t in separated.values())


def _reach_cell(page, m) -> str:
    """A docs table's "iterations to the target" cell: the first evaluation reaching it, mean +- std over the seeds
    that reached it (n reached / n)."""
    xs = [x for x in m["steps_to_target_raw"] if x is not None]
    if not xs:
        return f"not reached (0/{len(m['seeds'])})"
    return f"{xs[0]} (1/1)" if len(m["seeds"]) == 1 else f"{page.fmt(page.ms(xs), 0)} ({len(xs)}/{len(m['seeds'])})"


def test_diffusion_nft_numbers_are_the_committed_results():
    """docs/diffusion_nft.md's CFG-free table (the DiffusionNFT runs: 3 seeds at 3 rates, beside Flow-GRPO with CFG,
    iterations to Flow-GRPO's absolute target) and its t values are what results_page's "nft" panel and
    benchmarks/results/shapes_tier2_nft/results.json give; the README's trainer row quotes the same means."""
    page = _results_page()
    p = page.load_panel("nft")
    runs = json.load(open(os.path.join(ROOT, "benchmarks", "results", "shapes_tier2_nft", "results.json")))["runs"]
    flat = " ".join(open(os.path.join(ROOT, "docs", "diffusion_nft.md")).read().split())

    reach = functools.partial(_reach_cell, page)

    assert f"Flow-GRPO's target on this tier ({p['target']:.3f} strict)" in flat and f"({p['base']:.3f} strict" in flat
    nft, fg = [], []
    for lr in ("0.0005", "0.001", "0.002"):
        a, b = p["methods"][f"diffusion_nft@{lr}"], p["methods"][f"flow_grpo@{lr}"]
        assert len(a["seeds"]) == len(b["seeds"]) == 3, lr
        val = [r["evals"][-1]["val"]["overall"]["strict"] for r in runs if r["method"] == f"diffusion_nft@{lr}"]
        assert (f"| {lr} | {page.fmt(page.ms(a['final']))} | {page.fmt(page.ms(val))} | {page.fmt(page.ms(a['kl']))} "
                f"| {reach(a)} | {page.fmt(page.ms(b['final']))} | {page.fmt(page.ms(b['kl']))} "
                f"| {reach(b)} |") in flat, lr
        nft.append(statistics.mean(a["final"]))
        fg.append(statistics.mean(b["final"]))
    # the final-score t values the prose quotes: level at 5e-4, above at 2e-3, within the noise at 1e-3
    t = [page.welch_t(p["methods"][f"diffusion_nft@{lr}"]["final"], p["methods"][f"flow_grpo@{lr}"]["final"])
         for lr in ("0.0005", "0.001", "0.002")]
    assert f"at 5e-4 (Welch t {t[0]:+.1f}) and above it at 2e-3 (t {t[2]:+.1f})" in flat
    assert f"at 1e-3 t {t[1]:+.1f}" in flat
    words = [page.significance(p["methods"][f"diffusion_nft@{lr}"]["final"], p["methods"][f"flow_grpo@{lr}"]["final"],
                               better="higher")["word"] for lr in ("0.0005", "0.001", "0.002")]
    assert words == ["within the noise", "within the noise", "holds"]
    # the gain over its own base (with the base's binomial error) and the iterations to the target (interpolated)
    gains = [page.gain(p, f"diffusion_nft@{lr}") for lr in ("0.0005", "0.001", "0.002")]
    assert all(g["p"] < 0.001 for g in gains)
    assert (f"its sampling error: t {min(g['t'] for g in gains):+.1f} to {max(g['t'] for g in gains):+.1f}, p < 0.001 "
            "at each)") in flat
    steps = [page.compare(p, f"diffusion_nft@{lr}", f"flow_grpo@{lr}", "steps_to_target", "lower")
             for lr in ("0.0005", "0.002")]
    assert all(c["test"]["word"] == "within the noise" and 1.2 <= c["ratio"] < 1.35 for c in steps)
    assert (f"within the noise at 5e-4 and 2e-3 ({page.stat_text(steps[0]['test'])}; "
            f"{page.stat_text(steps[1]['test'])})") in flat


def test_diffusion_nft_tier3_numbers_are_the_committed_results():
    """docs/diffusion_nft.md's tier-3 table is results_page.nft_tier3_table of the committed runs (with CFG beside
    Flow-GRPO in shapes_tier3, without CFG in shapes_tier3_nft), 3 seeds at 1e-3 for both forms and Flow-GRPO; the
    prose's t values and words follow the numbers."""
    page = _results_page()
    cfg, free = page.load_panel("nft_t3_cfg"), page.load_panel("nft_t3")
    flat = " ".join(open(os.path.join(ROOT, "docs", "diffusion_nft.md")).read().split())
    rows = page.nft_tier3_table(cfg, free)
    for row in rows:
        assert row in flat, row
    assert any(r.startswith("| DiffusionNFT with CFG | 0.001 | 3 |") for r in rows)
    assert any(r.startswith("| DiffusionNFT without CFG | 0.001 | 3 |") for r in rows)
    ref = cfg["methods"]["flow_grpo@0.001"]
    t_cfg = [page.welch_t(cfg["methods"][f"diffusion_nft_cfg@{lr}"]["final"], ref["final"])
             for lr in ("0.0005", "0.001")]
    words = [page.significance(cfg["methods"][f"diffusion_nft_cfg@{lr}"]["final"], ref["final"])["word"]
             for lr in ("0.0005", "0.001")]
    assert f"within the noise (t {t_cfg[0]:+.1f}, {t_cfg[1]:+.1f};" in flat and all(t > 0 for t in t_cfg)
    assert words == ["within the noise"] * 2
    kl = sorted(statistics.mean(cfg["methods"][f"diffusion_nft_cfg@{lr}"]["kl"]) / statistics.mean(ref["kl"])
                for lr in ("0.0005", "0.001"))
    assert f"at {kl[0]:.2f}-{kl[1]:.2f}x its KL to the base" in flat
    fast = cfg["methods"]["diffusion_nft_cfg@0.002"]  # lr 2e-3: 3 seeds, each reaching the target
    assert len(fast["seeds"]) == 3 and None not in fast["steps_to_target"]
    t_fast = page.welch_t(fast["final"], ref["final"])
    assert (f"At 2e-3 it ends at {page.fmt(page.ms(fast['final']))} (t {t_fast:+.1f}) and reaches the target on every "
            f"seed, at iterations {', '.join(map(str, fast['steps_to_target_raw'][:-1]))} and "
            f"{fast['steps_to_target_raw'][-1]}, at {statistics.mean(fast['kl']) / statistics.mean(ref['kl']):.2f}x "
            "Flow-GRPO's KL") in flat and t_fast > 0
    assert page.significance(fast["final"], ref["final"])["word"] == "within the noise"
    free_rates = [free["methods"][f"diffusion_nft@{lr}"] for lr in ("0.0005", "0.001", "0.002")]
    assert all(len(m["seeds"]) == 3 for m in free_rates)
    finals = [statistics.mean(m["final"]) for m in free_rates]
    one = [page.gain(free, f"diffusion_nft@{lr}")["t"] for lr in ("0.0005", "0.001", "0.002")]
    t_val = [page.welch_t(m["final"], ref["final"]) for m in free_rates]
    t_test = [page.welch_t(m["final_by_split"]["test"], ref["final_by_split"]["test"]) for m in free_rates]
    assert (f"(val {free['base']:.3f} -> {min(finals):.3f} to {max(finals):.3f}, t {min(one):+.1f} to "
            f"{max(one):+.1f} against the base and its error, p < 0.001 at each)") in flat
    assert all(page.gain(free, f"diffusion_nft@{lr}")["p"] < 0.001 for lr in ("0.0005", "0.001", "0.002"))
    assert f"within the noise at every rate (t {max(t_val):+.1f} to {min(t_val):+.1f})" in flat
    assert all(t < 0 for t in t_val) and all(page.significance(m["final"], ref["final"])["word"] == "within the noise"
                                             for m in free_rates)
    reached = sum(s is not None for m in free_rates for s in m["steps_to_target"])
    assert f"{reached} seed of 9 reaches the target" in flat
    m = free_rates[1]  # lr 1e-3: test beyond the noise; the other two within it
    r_test = [page.significance(m["final_by_split"]["test"], ref["final_by_split"]["test"], better="lower")
              for m in free_rates]
    assert (f"({page.fmt(page.ms(m['final_by_split']['test']))} against "
            f"{page.fmt(page.ms(ref['final_by_split']['test']))}, Welch {page.stat_text(r_test[1])})") in flat
    assert [r["word"] for r in r_test] == ["within the noise", "holds", "within the noise"] and max(t_test) < 0
    assert f"within it at 5e-4 and 2e-3 ({page.stat_text(r_test[0])}; {page.stat_text(r_test[2])})" in flat


def test_set_a_cpu_reference_runs_repeat_the_committed_scores_and_give_the_cpu_claims():
    """benchmarks/results/shapes_tier2_cpu_ref: Flow-GRPO runs made again on the machine of DiffusionNFT's runs, so
    CPU to the target compares on one machine. Each repeats its shapes_tier2_op twin evaluation for evaluation (the
    harness is deterministic; only CPU seconds and the machine record differ). docs/diffusion_nft.md quotes the
    "nft_cpu" panel's CPU comparisons at lr 5e-4."""
    page = _results_page()
    folder = os.path.join(ROOT, "benchmarks", "results")
    ref = json.load(open(os.path.join(folder, "shapes_tier2_cpu_ref", "results.json")))["runs"]
    committed = {(r["method"], r["seed"]): r for r in json.load(open(os.path.join(folder, "shapes_tier2_op",
                                                                                   "results.json")))["runs"]}

    def restrict(new, old):  # new's values at old's keys (later runs also record the colour-relation accuracy)
        return {k: restrict(new[k], v) if isinstance(v, dict) else new[k] for k, v in old.items()
                if k not in ("cpu_s", "eval_cpu_s")}

    assert {(r["method"], r["seed"]) for r in ref} >= {("flow_grpo@0.0005", s) for s in (0, 1, 2)}
    for r in ref:
        twin = committed[(r["method"], r["seed"])]
        assert len(r["evals"]) == len(twin["evals"]) == 7
        assert [restrict(e, old) for e, old in zip(r["evals"], twin["evals"])] == [
            restrict(e, e) for e in twin["evals"]]
        assert [i["reward"] for i in r["iterations"]] == [i["reward"] for i in twin["iterations"]]
        assert r["machine"]["calibration_s"] > 0
    p = page.load_panel("nft_cpu")
    flat = " ".join(open(os.path.join(ROOT, "docs", "diffusion_nft.md")).read().split())
    for label in ("diffusion_nft_cfg@0.0005", "diffusion_nft@0.0005"):
        text, r = page.cell(p, label, "flow_grpo@0.0005", "cpu_to_target", "lower")
        assert r is not None and text in flat, text
        assert r["word"] == "within the noise"  # the prose calls both within the noise
    it = {label: statistics.mean(m["cpu_per_iter"]) for label, m in p["methods"].items()}
    f, c, n = it["flow_grpo@0.0005"], it["diffusion_nft_cfg@0.0005"], it["diffusion_nft@0.0005"]
    assert (
        f"Flow-GRPO costs {f:.1f} CPU-s, DiffusionNFT with CFG {c:.1f} ({c / f:.2f}x: every training point") in flat
    assert f"and without CFG {n:.1f} ({n / f:.2f}x)" in flat


def test_diffusion_nft_with_cfg_numbers_are_the_committed_results():
    """docs/diffusion_nft.md's with-CFG table (DiffusionNFT beside Flow-GRPO from the same CFG base, one row per rate
    run so far, with its seed count) and the lr-1e-3 sentence are results_page's "nft_cfg" panel."""
    page = _results_page()
    p = page.load_panel("nft_cfg")
    flat = " ".join(open(os.path.join(ROOT, "docs", "diffusion_nft.md")).read().split())

    reach = functools.partial(_reach_cell, page)

    rates = [lr for lr in ("0.0005", "0.001", "0.002") if f"diffusion_nft_cfg@{lr}" in p["methods"]]
    assert "0.001" in rates
    for lr in rates:
        a, b = p["methods"][f"diffusion_nft_cfg@{lr}"], p["methods"][f"flow_grpo@{lr}"]
        r = page.significance(a["final"], b["final"])
        row = (f"| {lr} | {len(a['seeds'])} | {page.fmt(page.ms(a['final']))} | {page.fmt(page.ms(a['kl']))} | "
               f"{reach(a)} | {page.fmt(page.ms(b['final']))} | {page.fmt(page.ms(b['kl']))} | {reach(b)} | "
               + ("n/a (one seed)" if r["t"] is None else page.stat_text(r)) + " |")
        assert row in flat, row
    a, b = p["methods"]["diffusion_nft_cfg@0.001"], p["methods"]["flow_grpo@0.001"]
    t = page.welch_t(a["final"], b["final"])
    assert len(a["seeds"]) == len(b["seeds"]) == 3 and page.significance(a["final"], b["final"], better="higher")[
        "word"] == "holds"
    assert (f"({page.fmt(page.ms(a['final']))} against {page.fmt(page.ms(b['final']))}, Welch t {t:+.1f}) at a "
            f"quarter of its KL") in flat and 0.2 <= statistics.mean(a["kl"]) / statistics.mean(b["kl"]) <= 0.3
    # iterations to the target at 5e-4: the interpolated crossings (the page's), within the noise at 3 seeds
    c = page.compare(p, "diffusion_nft_cfg@0.0005", "flow_grpo@0.0005", "steps_to_target", "lower")
    assert (f"(interpolated crossings {page.fmt(c['a'], 0)} against {page.fmt(c['b'], 0)}: {c['ratio']:.2f}x, "
            f"{page.stat_text(c['test'])}, all seeds reaching it)") in flat
    assert c["test"]["word"] == "within the noise" and c["t"] < 0 and c["na"] == c["nb"] == 3
    c = page.compare(p, "diffusion_nft_cfg@0.002", "flow_grpo@0.002", "steps_to_target", "lower")
    quoted = f"{page.fmt(c['a'], 0)} against {page.fmt(c['b'], 0)} ({page.stat_text(c['test'])}, within the noise)"
    assert quoted in flat
    assert c["test"]["word"] == "within the noise"
    # what the README's trainer table says of DiffusionNFT with CFG: above Flow-GRPO on set A at lr 1e-3 and 2e-3,
    # at a third of its KL or less
    for lr in ("0.001", "0.002"):
        a, b = p["methods"][f"diffusion_nft_cfg@{lr}"], p["methods"][f"flow_grpo@{lr}"]
        assert page.significance(a["final"], b["final"], better="higher")["word"] == "holds", lr
        assert statistics.mean(a["kl"]) <= statistics.mean(b["kl"]) / 3, lr


def test_readme_table_cells_are_short():
    """README tables stay readable on a first screen: no cell over 160 characters (long stories go to docs/)."""
    long = [(n, len(cell)) for n, line in enumerate(open(os.path.join(ROOT, "README.md"), encoding="utf-8"), 1)
            if line.startswith("|") for cell in line.strip().strip("|").split(" | ") if len(cell) > 160]
    assert long == []


def _benchmark_module(name: str):
    """benchmarks/<name>.py as a fresh module."""
    import importlib.util

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))  # full_size imports overhead's helpers
    spec = importlib.util.spec_from_file_location(f"_docs_{name}", os.path.join(ROOT, "benchmarks", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # a dataclass in the module looks its module up there
    spec.loader.exec_module(module)
    return module


def test_performance_page_tables_are_the_committed_measurements():
    """docs/performance.md's CPU table is benchmarks/results/throughput.json rendered, and its full-size table the
    committed full_size JSON (a GPU run's, or the dry run's "not run on a GPU yet" rows)."""
    with open(os.path.join(ROOT, "docs", "performance.md"), encoding="utf-8") as f:
        page = f.read()
    throughput = _benchmark_module("throughput")
    with open(throughput.OUT) as f:
        assert throughput.render_page_block(json.load(f)) in page
    full_size = _benchmark_module("full_size")
    results = os.path.join(ROOT, "benchmarks", "results")
    path = next(p for p in (os.path.join(results, n) for n in ("full_size.json", "full_size_dry_run.json"))
                if os.path.exists(p))
    with open(path) as f:
        table = full_size.render_table(json.load(f))
    assert f"{full_size.TABLE_START}\n{table}" in page


def test_performance_page_fast_settings_verdict_is_the_committed_runs():
    """docs/performance.md's words on the Flow-GRPO-Fast runs: under half the CPU an iteration, a lower final score,
    about twice the KL to the base, below the base on the held-out val prompts, no seed at the target."""
    p = _results_page().load_panel("fast")
    fast, grpo = p["methods"]["flow_grpo_fast_mixed@0.001"], p["methods"]["flow_grpo_mixed@0.001"]
    assert len(fast["seeds"]) >= 3 and len(grpo["seeds"]) >= 3
    assert statistics.mean(fast["cpu_per_iter"]) < 0.5 * statistics.mean(grpo["cpu_per_iter"])
    assert statistics.mean(fast["final"]) < statistics.mean(grpo["final"])
    assert 1.5 < statistics.mean(fast["kl"]) / statistics.mean(grpo["kl"]) < 2.5
    assert statistics.mean(fast["final_by_split"]["val"]) < p["base_by_split"]["val"]
    assert all(s is None for s in fast["steps_to_target"])
