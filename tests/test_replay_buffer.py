"""Tests for trl_flow.replay_buffer (OP-GRPO high-quality replay buffer)."""

import json
import math
import time
import warnings
from unittest import mock

import datasets
import pytest
import torch

from trl_flow.replay_buffer import ReplayBuffer, ReplayEntry

K_OFF = 3
LATENT = (3, 8, 8)


def make_entry(prompt, reward, step=0, k_off=K_OFF, latent=LATENT, seed=0, columns=None):
    g = torch.Generator().manual_seed(seed)
    return ReplayEntry(
        prompt=prompt,
        columns={"idx": seed, "tag": f"t{seed}"} if columns is None else columns,
        states=torch.randn((k_off + 1, *latent), generator=g),
        log_probs=torch.randn(k_off, generator=g),
        sigmas=torch.linspace(1.0, 0.5, k_off + 1),
        reward=reward,
        step=step,
    )


# ---------------------------------------------------------------------------------------------- uniqueness
def test_one_entry_per_prompt_better_replaces_worse_fresh_rejected():
    buf = ReplayBuffer(capacity=8, decay=0.05)
    assert buf.offer(make_entry("a", 1.0, step=5, seed=1), now=5)
    assert len(buf) == 1 and "a" in buf
    # better trajectory for the same prompt replaces
    assert buf.offer(make_entry("a", 2.0, step=5, seed=2), now=5)
    assert len(buf) == 1 and buf.get("a").reward == 2.0
    assert buf.get("a").columns["idx"] == 2
    # a worse fresh one is rejected while the stored one is fresh (age 0)
    assert not buf.offer(make_entry("a", 1.5, step=5, seed=3), now=5)
    assert len(buf) == 1 and buf.get("a").reward == 2.0 and buf.get("a").columns["idx"] == 2
    # a tie goes to the newer trajectory
    assert buf.offer(make_entry("a", 2.0, step=5, seed=4), now=5) and buf.get("a").columns["idx"] == 4
    assert buf.get("missing") is None and "missing" not in buf


def test_stored_entry_is_a_detached_copy():
    buf = ReplayBuffer()
    e = make_entry("a", 1.0)
    buf.offer(e, now=0)
    e.states.add_(100.0)
    assert not torch.equal(buf.get("a").states, e.states)


# ---------------------------------------------------------------------------------------------- decay
@pytest.mark.parametrize("offset", [0.0, -10.0])  # all-positive and all-negative rewards
def test_decay_makes_old_entry_replaceable_only_when_old(offset):
    def run(age):
        buf = ReplayBuffer(capacity=8, decay=0.05)
        assert buf.offer(make_entry("a", offset + 1.0, step=0), now=0)
        # a slightly worse new trajectory, offered `age` iterations later
        return buf.offer(make_entry("a", offset + 0.9, step=age, seed=1), now=age), buf

    stored, buf = run(age=1)  # young: 1.0 - 0.05 * 1 * std(1.0, 0.9)=0.997 > 0.9 -> rejected
    assert not stored and buf.get("a").reward == offset + 1.0
    stored, buf = run(age=100)  # old: 1.0 - 0.05 * 100 * 0.0707 = 0.646 < 0.9 -> replaced
    assert stored and buf.get("a").reward == offset + 0.9 and buf.get("a").step == 100


def test_priority_is_sign_correct_and_scale_free():
    for c in (1.0, 1000.0, -1.0, -0.001):  # positive and all-negative rewards, several scales
        buf = ReplayBuffer(capacity=8, decay=0.1)
        for i, r in enumerate([0.2, 0.5, 0.9, 0.4]):
            buf.offer(make_entry(f"p{i}", c * r, step=0), now=0)
        e = buf.get("p0")
        # priority strictly decreases with age, whatever the sign of the reward
        assert buf.priority(e, now=10) < buf.priority(e, now=1) < buf.priority(e, now=0) == e.reward
    # scale-free: multiplying every reward by c scales all priorities by c (same decisions)
    b1, b2 = ReplayBuffer(decay=0.1), ReplayBuffer(decay=0.1)
    for i, r in enumerate([0.3, -0.7, 1.2, 0.1]):
        b1.offer(make_entry(f"p{i}", r, step=i), now=i)
        b2.offer(make_entry(f"p{i}", 1000.0 * r, step=i), now=i)
    for p in b1.prompts:
        assert b2.priority(b2.get(p), 20) == pytest.approx(1000.0 * b1.priority(b1.get(p), 20), rel=1e-9)
    assert ReplayBuffer().reward_scale == 1.0


# ---------------------------------------------------------------------------------------------- capacity
def test_capacity_evicts_lowest_priority_and_rejects_below_all():
    buf = ReplayBuffer(capacity=3, decay=0.05)
    for p, r in [("a", 0.5), ("b", 0.1), ("c", 0.9)]:
        assert buf.offer(make_entry(p, r, step=0), now=0)
    assert len(buf) == 3
    # new prompt better than the lowest (b, 0.1): b is evicted
    assert buf.offer(make_entry("d", 0.3, step=0), now=0)
    assert len(buf) == 3 and "b" not in buf and set(buf.prompts) == {"a", "c", "d"}
    # a candidate below every stored priority is rejected, nothing evicted
    assert not buf.offer(make_entry("e", 0.05, step=0), now=0)
    assert set(buf.prompts) == {"a", "c", "d"}
    # a candidate tying the lowest stored priority (d, 0.3) is rejected too: eviction needs strictly higher
    assert not buf.offer(make_entry("f", 0.3, step=0), now=0)
    assert set(buf.prompts) == {"a", "c", "d"}
    assert buf.counters["evicted"] == 1 and buf.counters["rejected"] == 2


def test_capacity_eviction_uses_decayed_priority_negative_rewards():
    buf = ReplayBuffer(capacity=2, decay=0.5)
    assert buf.offer(make_entry("old", -1.0, step=0), now=0)  # higher reward, but will be old
    assert buf.offer(make_entry("young", -2.0, step=10), now=10)
    # at now=10: old has -1 - 0.5 * 10 * scale < -2 (scale = std(-1, -2) ~ 0.707), so it is the lowest
    assert buf.offer(make_entry("new", -1.5, step=10), now=10)
    assert set(buf.prompts) == {"young", "new"}


# ---------------------------------------------------------------------------------------------- validation
@pytest.mark.parametrize("field", ["states", "log_probs", "sigmas", "reward"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_rejected_and_buffer_unchanged(field, bad):
    buf = ReplayBuffer(capacity=4)
    buf.offer(make_entry("a", 1.0), now=0)
    buf.offer(make_entry("b", 0.5), now=0)
    before = {p: (buf.get(p).reward, buf.get(p).states.clone()) for p in buf.prompts}
    scale_before, counters_before = buf.reward_scale, dict(buf.counters)
    for prompt in ("a", "new"):  # same prompt (would replace) and a new prompt (would insert)
        e = make_entry(prompt, 5.0, seed=9)
        if field == "reward":
            e.reward = bad
        else:
            getattr(e, field).view(-1)[1] = bad
        with pytest.warns(RuntimeWarning, match="non-finite"):
            assert not buf.offer(e, now=0)
    assert set(buf.prompts) == {"a", "b"}
    for p, (r, s) in before.items():
        assert buf.get(p).reward == r and torch.equal(buf.get(p).states, s)
    assert buf.reward_scale == scale_before
    assert buf.counters["rejected_nonfinite"] == counters_before["rejected_nonfinite"] + 2
    assert all(math.isfinite(v) for v in buf.stats(now=0).values())


def test_shape_and_dtype_validation():
    buf = ReplayBuffer()
    buf.offer(make_entry("a", 1.0), now=0)
    with pytest.raises(ValueError, match=r"states.*expected \(4, 3, 8, 8\)"):
        buf.offer(make_entry("b", 1.0, latent=(3, 8, 9)), now=0)
    with pytest.raises(ValueError, match="states"):  # different k_off changes the states shape too
        buf.offer(make_entry("b", 1.0, k_off=2), now=0)
    e = make_entry("b", 1.0)
    e.log_probs = e.log_probs[:2]
    with pytest.raises(ValueError, match="states"):
        buf.offer(e, now=0)
    e = make_entry("b", 1.0)
    e.sigmas = e.sigmas[:3]
    with pytest.raises(ValueError, match="sigmas"):
        buf.offer(e, now=0)
    e = make_entry("b", 1.0)
    e.states = e.states.double()
    with pytest.raises(ValueError, match="states.*float32"):
        buf.offer(e, now=0)
    e = make_entry("b", 1.0)
    e.log_probs = e.log_probs.half()
    with pytest.raises(ValueError, match="log_probs"):
        buf.offer(e, now=0)
    assert buf.prompts == ["a"]


# ---------------------------------------------------------------------------------------------- sampling
def _filled(n=20, **kw):
    buf = ReplayBuffer(capacity=64, **kw)
    for i in range(n):
        buf.offer(make_entry(f"p{i:02d}", float(i % 7), step=i, seed=i), now=i)
    return buf


def test_uniform_sample_deterministic_distinct_and_exclude():
    buf = _filled()
    pick = lambda seed, **kw: [
        e.prompt for e in buf.sample(8, now=20, generator=torch.Generator().manual_seed(seed), **kw)]
    a, b, c = pick(0), pick(0), pick(1)
    assert a == b and a != c
    assert len(a) == 8 and len(set(a)) == 8
    excl = set(a[:5])
    d = pick(0, exclude=excl)
    assert len(d) == 8 and not excl & set(d) and len(set(d)) == 8
    # fewer than n available
    many = buf.sample(100, now=20, generator=torch.Generator().manual_seed(0), exclude={"p00", "p01"})
    assert len(many) == 18 and len({e.prompt for e in many}) == 18
    assert buf.sample(0, now=20) == [] and ReplayBuffer().sample(4, now=0) == []
    # all 20 prompts are reachable (not always the same subset)
    seen = set()
    for s in range(30):
        seen |= set(pick(s))
    assert len(seen) == 20


def test_priority_sampling_takes_highest():
    buf = _filled(sampling="priority", decay=0.0)
    got = buf.sample(3, now=20, exclude={"p06"})
    # rewards i % 7: reward 6 at p06 (excluded) and p13, then 5 at p05, p12, p19 (newer first)
    assert [e.prompt for e in got] == ["p13", "p19", "p12"]
    stats = buf.stats(now=20)
    assert stats["size"] == 20 and stats["max_age"] == 20 and stats["mean_age"] == pytest.approx(10.5)
    assert stats["mean_reward"] == pytest.approx(sum(i % 7 for i in range(20)) / 20)


# ---------------------------------------------------------------------------------------------- persistence
def _assert_same(b1, b2):
    assert b1.prompts == b2.prompts and len(b1) == len(b2)
    assert (b1.capacity, b1.decay, b1.sampling, b1.per_prompt) == (b2.capacity, b2.decay, b2.sampling, b2.per_prompt)
    assert (b1._n, b1._mean, b1._m2) == (b2._n, b2._mean, b2._m2)
    assert b1.reward_scale == b2.reward_scale and b1.states_shape == b2.states_shape
    assert b1.counters == b2.counters
    for e1, e2 in zip(b1, b2):  # every entry, in order
        assert e1.prompt == e2.prompt
        for f in ("states", "log_probs", "sigmas"):
            t1, t2 = getattr(e1, f), getattr(e2, f)
            assert t2.dtype == torch.float32 and torch.equal(t1, t2), f
        assert e1.reward == e2.reward and e1.step == e2.step and e1.columns == e2.columns
        assert type(e2.reward) is float and type(e2.step) is int


def test_persistence_round_trip_bit_exact_and_fast(tmp_path):
    buf = ReplayBuffer(capacity=100, decay=0.07, sampling="priority")
    for i in range(64):
        g = torch.Generator().manual_seed(i)
        e = ReplayEntry(
            prompt=f"prompt {i} ünïcode",
            columns={"idx": i, "tags": ["x", i], "meta": {"w": 0.1 * i}, "none": None},
            states=torch.randn(4, 3, 16, 16, generator=g) * 10.0 ** (i % 9 - 4),
            log_probs=torch.randn(3, generator=g) * 1e3,
            sigmas=torch.linspace(1.0, 0.25, 4) + 1e-7 * i,
            reward=-0.1 * i + 1 / 3,
            step=i,
        )
        assert buf.offer(e, now=i)
    t0 = time.perf_counter()
    buf.save_to_disk(tmp_path / "rb")
    t_save = time.perf_counter() - t0
    t0 = time.perf_counter()
    re = ReplayBuffer.load_from_disk(tmp_path / "rb")
    t_load = time.perf_counter() - t0
    print(f"64-entry buffer: save {t_save * 1e3:.1f} ms, load {t_load * 1e3:.1f} ms")
    assert t_load < 0.5
    _assert_same(buf, re)
    # explicit features
    ds = datasets.load_from_disk(str(tmp_path / "rb"))
    assert isinstance(ds.features["states"], datasets.Array4D) and ds.features["states"].shape == (4, 3, 16, 16)
    assert ds.features["reward"] == datasets.Value("float64") and ds.features["step"] == datasets.Value("int64")
    assert json.loads(ds.info.description)["decay"] == 0.07
    # the reloaded buffer behaves identically
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert [e.prompt for e in buf.sample(5, 70, g1)] == [e.prompt for e in re.sample(5, 70, g2)]
    # kwargs override the stored config
    assert ReplayBuffer.load_from_disk(tmp_path / "rb", decay=0.5).decay == 0.5


@pytest.mark.parametrize("latent", [(), (5,), (3, 4, 5, 6)])  # flat fallback, Array2D, Array5D
def test_round_trip_other_ndims(tmp_path, latent):
    buf = ReplayBuffer(capacity=4)
    for i in range(3):
        buf.offer(make_entry(f"p{i}", float(i), step=i, latent=latent, seed=i), now=i)
    buf.save_to_disk(tmp_path / "rb")
    _assert_same(buf, ReplayBuffer.load_from_disk(tmp_path / "rb"))


def test_empty_buffer_round_trip(tmp_path):
    buf = ReplayBuffer(capacity=7, decay=0.2, sampling="priority")
    buf.save_to_disk(tmp_path / "empty")
    re = ReplayBuffer.load_from_disk(tmp_path / "empty")
    assert len(re) == 0 and (re.capacity, re.decay, re.sampling) == (7, 0.2, "priority")
    assert re.states_shape is None and re.sample(3, now=0) == []
    assert re.offer(make_entry("a", 1.0), now=0) and len(re) == 1


def test_from_dataset_without_metadata_and_capacity_override():
    buf = _filled(10)
    ds = buf.to_dataset()
    ds = datasets.Dataset.from_dict(ds.to_dict(), features=ds.features)  # drops info.description
    with pytest.warns(RuntimeWarning):
        re = ReplayBuffer.from_dataset(ds, capacity=4, decay=0.0)
    assert len(re) == 4 and re.capacity == 4
    # kept the highest-reward rows (decay 0): rewards i % 7 for i < 10 -> 6, 5, 4, 3
    assert sorted(e.reward for e in re) == [3.0, 4.0, 5.0, 6.0]


# ---------------------------------------------------------------------------------------------- config / hub
@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"capacity": 0}, "capacity"),
        ({"capacity": -3}, "capacity"),
        ({"decay": -0.1}, "decay"),
        ({"decay": float("nan")}, "decay"),
        ({"sampling": "softmax"}, "sampling"),
        ({"per_prompt": 0}, "per_prompt"),
        ({"per_prompt": 1.5}, "per_prompt"),
    ],
)
def test_bad_constructor_args(kwargs, name):
    with pytest.raises(ValueError, match=name) as info:
        ReplayBuffer(**kwargs)
    if name == "sampling":
        assert "uniform" in str(info.value) and "priority" in str(info.value)


def test_push_to_hub_calls_datasets_with_repo_id():
    buf = _filled(3)
    with mock.patch.object(datasets.Dataset, "push_to_hub", autospec=True, return_value="ok") as push:
        assert buf.push_to_hub("user/op-grpo-buffer", private=True) == "ok"
    push.assert_called_once()
    ds_arg, repo = push.call_args.args
    assert repo == "user/op-grpo-buffer" and push.call_args.kwargs == {"private": True}
    assert isinstance(ds_arg, datasets.Dataset) and len(ds_arg) == 3


# ------------------------------------------------------------------------- several entries per prompt (the
# replay-share change)
def test_per_prompt_keeps_the_best_distinct_trajectories_of_a_prompt():
    buf = ReplayBuffer(capacity=8, decay=0.0, per_prompt=3)
    for seed, reward in enumerate([1.0, 3.0, 2.0]):
        assert buf.offer(make_entry("a", reward, seed=seed), now=0)
    assert len(buf) == 3 and buf.prompts == ["a"] and sorted(e.reward for e in buf.entries_of("a")) == [1.0, 2.0, 3.0]
    assert buf.get("a").reward == 3.0  # the best of the prompt's entries
    # the prompt is full: a better one replaces its lowest, a worse one is rejected, a tie goes to the newer one
    assert buf.offer(make_entry("a", 1.5, seed=10), now=0)
    assert sorted(e.reward for e in buf.entries_of("a")) == [1.5, 2.0, 3.0]
    assert not buf.offer(make_entry("a", 1.0, seed=11), now=0)
    assert buf.offer(make_entry("a", 1.5, seed=12), now=0)
    assert {e.columns["idx"] for e in buf.entries_of("a")} == {12, 1, 2}
    # capacity counts entries: prompts with free slots compete on the global lowest priority
    for i in range(5):
        assert buf.offer(make_entry(f"b{i}", 5.0 + i, seed=20 + i), now=0)
    assert len(buf) == 8
    assert buf.offer(make_entry("c", 4.0, seed=30), now=0)  # evicts the global lowest (a's 1.5)
    assert len(buf) == 8 and sorted(e.reward for e in buf.entries_of("a")) == [2.0, 3.0]
    assert not buf.offer(make_entry("d", 0.5, seed=31), now=0)


def test_no_duplicate_trajectories():
    buf = ReplayBuffer(capacity=8, per_prompt=3)
    e = make_entry("a", 1.0, seed=1)
    assert buf.offer(e, now=0)
    # the same trajectory again (even with another reward or step) is refused: a prompt's entries are distinct
    again = make_entry("a", 9.0, step=1, seed=1)
    assert not buf.offer(again, now=1)
    assert len(buf) == 1 and buf.counters["rejected_duplicate"] == 1 and buf.counters["offered"] == 1
    # the same states under another prompt are another entry
    assert buf.offer(make_entry("b", 1.0, seed=1), now=1) and len(buf) == 2
    # a dataset holding one trajectory twice is refused on load
    ds = buf.to_dataset()
    rows = ds.to_dict()
    dup = datasets.Dataset.from_dict({k: v + v[:1] for k, v in rows.items()}, features=ds.features, info=ds.info)
    with pytest.raises(ValueError, match="repeats a stored trajectory"):
        ReplayBuffer.from_dataset(dup)


def test_sample_groups_distinct_prompts_and_entries():
    buf = ReplayBuffer(capacity=64, per_prompt=4)
    for p in range(6):
        for j in range(4 if p < 4 else 1):
            buf.offer(make_entry(f"p{p}", float(j), step=0, seed=10 * p + j), now=0)
    got = buf.sample_groups([3, 3, 2], now=0, generator=torch.Generator().manual_seed(0))
    assert len(got) == 3 and len({g[0].prompt for g in got}) == 3
    for g, k in zip(got, [3, 3, 2]):  # k distinct entries of one prompt, or all it has when it has fewer
        assert len({e.prompt for e in g}) == 1 and len({id(e) for e in g}) == len(g)
        assert len(g) == min(k, len(buf.entries_of(g[0].prompt)))
    flat = [id(e) for g in got for e in g]
    assert len(flat) == len(set(flat))  # never the same entry twice
    again = buf.sample_groups([3, 3, 2], now=0, generator=torch.Generator().manual_seed(0))
    assert [[id(e) for e in g] for g in again] == [[id(e) for e in g] for g in got]  # deterministic
    # a prompt with 4 entries asked for 3 draws among them; one with 1 entry serves 1
    assert buf.sample_groups([3], now=0, exclude={f"p{i}" for i in range(5)})[0] == buf.entries_of("p5")
    prio = ReplayBuffer(capacity=64, per_prompt=4, sampling="priority", decay=0.0)
    for e in buf:
        prio.offer(e, now=0)
    top = prio.sample_groups([2], now=0, exclude={"p4", "p5"})[0]
    assert sorted(e.reward for e in top) == [2.0, 3.0]
    # sample(n) is one entry of n distinct prompts
    assert len({e.prompt for e in buf.sample(6, now=0)}) == 6


def test_per_prompt_round_trip(tmp_path):
    buf = ReplayBuffer(capacity=16, decay=0.1, per_prompt=3)
    for p in range(3):
        for j in range(3):
            buf.offer(make_entry(f"p{p}", float(p + j), step=j, seed=10 * p + j), now=2)
    buf.save_to_disk(tmp_path / "rb")
    re = ReplayBuffer.load_from_disk(tmp_path / "rb")
    assert re.per_prompt == 3 and len(re) == 9
    _assert_same(buf, re)
    with pytest.raises(ValueError, match="per_prompt"):  # more rows of a prompt than asked for: refused, not cut
        ReplayBuffer.load_from_disk(tmp_path / "rb", per_prompt=2)


def _as_format_1(path):
    """Rewrite a saved one-entry-per-prompt buffer's metadata as trl_flow wrote it before the replay-share change."""
    info_file = path / "dataset_info.json"
    info = json.loads(info_file.read_text())
    meta = json.loads(info["description"])
    meta["version"] = 1
    meta.pop("per_prompt")
    meta["counters"].pop("rejected_duplicate")
    info["description"] = json.dumps(meta)
    info_file.write_text(json.dumps(info))


def test_format_1_buffer_loads_as_one_per_prompt_or_converts_explicitly(tmp_path):
    buf = _filled(5)
    buf.save_to_disk(tmp_path / "old")
    _as_format_1(tmp_path / "old")
    assert "per_prompt" not in json.loads(datasets.load_from_disk(str(tmp_path / "old")).info.description)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # same meaning: no conversion, no warning
        old = ReplayBuffer.load_from_disk(tmp_path / "old")
    assert old.per_prompt == 1 and old.prompts == buf.prompts
    with pytest.warns(UserWarning, match="converting a format-1 replay buffer .* per_prompt=4"):
        conv = ReplayBuffer.load_from_disk(tmp_path / "old", per_prompt=4)
    assert conv.per_prompt == 4 and [e.reward for e in conv] == [e.reward for e in buf]
    assert conv.offer(make_entry("p00", -100.0, step=30, seed=99), now=30) and len(conv.entries_of("p00")) == 2
