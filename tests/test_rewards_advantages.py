"""Reward combination (trl_flow.rewards) and group-relative advantages (trl_flow.advantages), checked by hand."""

from __future__ import annotations

import math

import pytest
import torch

from trl_flow.advantages import group_advantages, normalize_jointly
from trl_flow.rewards import (
    compute_rewards,
    jpeg_compressibility,
    jpeg_incompressibility,
    reward_name,
    validate_reward_funcs,
)

NAN = float("nan")
IMAGES = torch.full((4, 3, 8, 8), 0.5)
PROMPTS4 = ["p0", "p1", "p2", "p3"]


def _const(name, values):
    def f(images, prompts, **kwargs):
        return list(values) if isinstance(values, list) else values

    f.__name__ = name
    return f


def _combine(funcs, weights=None, columns=None):
    funcs, names, weights = validate_reward_funcs(funcs, weights)
    return compute_rewards(funcs, names, weights, IMAGES, PROMPTS4, columns or {})


def _same(t, expected):
    """Exact comparison that treats NaN == NaN."""
    exp = torch.tensor(expected, dtype=torch.float32)
    return t.shape == exp.shape and bool(((t == exp) | (torch.isnan(t) & torch.isnan(exp))).all())


# -------------------------------------------------------------------------------------------- combination
def test_weighted_sum_of_rewards():
    total, per = _combine([_const("a", [1, 2, 3, 4]), _const("b", [10, 20, 30, 40])], [1.0, 0.5])
    assert _same(total, [6.0, 12.0, 18.0, 24.0])
    assert list(per) == ["a", "b"]
    assert _same(per["a"], [1, 2, 3, 4]) and _same(per["b"], [10, 20, 30, 40])


def test_default_weights_are_one_and_tensor_output_accepted():
    def t(images, prompts, **kwargs):
        return torch.tensor([[1.0], [2.0], [3.0], [4.0]])  # any shape with B values

    total, _ = _combine([t, _const("b", [1, 1, 1, 1])])
    assert _same(total, [2.0, 3.0, 4.0, 5.0])


def test_none_and_nan_are_skipped_per_reward_and_per_sample():
    a = _const("a", [1.0, None, NAN, None])
    b = _const("b", [10.0, 20.0, NAN, None])
    total, per = _combine([a, b], [1.0, 2.0])
    # sample 0: 1 + 2*10; sample 1: a skipped -> 2*20; samples 2, 3: nothing scored -> NaN
    assert _same(total, [21.0, 40.0, NAN, NAN])
    assert _same(per["a"], [1.0, NAN, NAN, NAN]) and _same(per["b"], [10.0, 20.0, NAN, NAN])


def test_all_none_gives_nan_and_inf_counts_as_missing():
    total, _ = _combine([_const("a", [None] * 4)])
    assert bool(torch.isnan(total).all())
    total, per = _combine([_const("a", [math.inf, -math.inf, 1.0, 2.0]), _const("b", [1.0, None, 1.0, 1.0])])
    assert _same(total, [1.0, NAN, 2.0, 3.0])
    assert _same(per["a"], [NAN, NAN, 1.0, 2.0])


def test_columns_are_passed_to_rewards():
    seen = {}

    def r(images, prompts, **kwargs):
        seen.update(kwargs, prompts=prompts, n=len(images))
        return [float(x) for x in kwargs["score"]]

    total, _ = _combine([r], columns={"score": [3, 1, 4, 1], "tag": list("abcd")})
    assert _same(total, [3.0, 1.0, 4.0, 1.0])
    assert seen["tag"] == list("abcd") and seen["prompts"] == PROMPTS4 and seen["n"] == 4


@pytest.mark.parametrize(
    "values,match",
    [([1.0, 2.0, 3.0], "3 values for 4"), ([1.0] * 5, "5 values for 4"), (["x", 1, 2, 3], "non-numbers"),
     (5.0, "returned a float"), ([[1, 2], 1, 2, 3], "non-numbers"), (["0.5", 1, 2, 3], "'0.5'"),
     ({"a": 1.0}, "returned a dict"), ("1234", "returned a str")],
)
def test_bad_reward_output_raises_runtime_error_naming_it(values, match):
    bad = _const("my_bad_reward", values)
    with pytest.raises(RuntimeError, match="my_bad_reward") as info:
        _combine([_const("fine", [0.0] * 4), bad])
    assert match in str(info.value)
    assert "return a list of" in str(info.value) and "floats" in str(info.value)


def test_raising_reward_is_wrapped_naming_it():
    def exploding(images, prompts, **kwargs):
        raise KeyError("boom")

    with pytest.raises(RuntimeError, match="exploding.*KeyError") as info:
        _combine([exploding])
    assert isinstance(info.value.__cause__, KeyError)


def test_reward_names_are_unique_and_weights_checked():
    class Scorer:
        def __call__(self, images, prompts, **kwargs):
            return [1.0] * len(prompts)

    assert reward_name(Scorer()) == "Scorer"
    funcs, names, weights = validate_reward_funcs([Scorer(), Scorer(), jpeg_compressibility], None)
    assert names == ["Scorer", "Scorer_1", "jpeg_compressibility"] and weights == [1.0, 1.0, 1.0]
    funcs, names, weights = validate_reward_funcs(jpeg_compressibility, [2])
    assert funcs == [jpeg_compressibility] and weights == [2.0]
    with pytest.raises(ValueError, match="reward_weights"):
        validate_reward_funcs([Scorer(), Scorer()], [1.0])
    with pytest.raises(ValueError, match="reward_weights"):
        validate_reward_funcs([Scorer()], [math.nan])
    with pytest.raises(TypeError, match=r"reward_funcs\[1\]"):
        validate_reward_funcs([Scorer(), "not a function"], None)
    with pytest.raises(ValueError, match="reward_funcs"):
        validate_reward_funcs([], None)


# -------------------------------------------------------------------------------------------------- jpeg
def test_jpeg_rewards_are_monotone_in_image_noise():
    g = torch.Generator().manual_seed(0)
    base = torch.full((1, 3, 64, 64), 0.5)
    noise = torch.rand((1, 3, 64, 64), generator=g) - 0.5
    images = torch.cat([base, base + 0.05 * noise, base + 0.3 * noise, base + 1.0 * noise]).clamp(0, 1)
    sizes = jpeg_incompressibility(images, ["p"] * 4)
    assert all(isinstance(s, float) for s in sizes)
    assert sizes[0] < sizes[1] < sizes[2] < sizes[3], sizes
    assert sizes[3] > 3 * sizes[0]  # noise is far less compressible than a flat image
    comp = jpeg_compressibility(images, ["p"] * 4)
    assert comp == [-s for s in sizes]
    # the value is the JPEG size in kB at quality 95, computed independently with PIL
    import io

    from PIL import Image

    arr = (images[2].permute(1, 2, 0).numpy() * 255).round().astype("uint8")
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="JPEG", quality=95)
    assert sizes[2] == pytest.approx(buf.tell() / 1000, rel=1e-9)


def test_jpeg_reward_on_video():
    g = torch.Generator().manual_seed(0)
    video = torch.rand((2, 3, 3, 16, 16), generator=g)  # (B, F, 3, H, W)
    video[0] = 0.5
    sizes = jpeg_incompressibility(video, ["a", "b"])
    assert len(sizes) == 2 and sizes[0] < sizes[1]


# ------------------------------------------------------------------------------------------------ advantages
def _pop_std(xs):
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))


REWARDS = [1.0, 2.0, 3.0, 4.0, 10.0, 10.0, 10.0, 14.0]
GROUPS = [0, 0, 0, 0, 1, 1, 1, 1]


def _check(adv, expected, tol=1e-6):
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=torch.float32), rtol=tol, atol=tol)


def test_group_advantages_group_scaling_by_hand():
    adv = group_advantages(torch.tensor(REWARDS), torch.tensor(GROUPS), "group")
    s0, s1 = math.sqrt(1.25), math.sqrt(3.0)  # population stds of the two groups
    expected = [(r - 2.5) / (s0 + 1e-4) for r in REWARDS[:4]] + [(r - 11.0) / (s1 + 1e-4) for r in REWARDS[4:]]
    _check(adv, expected)


def test_group_advantages_batch_scaling_by_hand():
    adv = group_advantages(torch.tensor(REWARDS), torch.tensor(GROUPS), "batch")
    sb = _pop_std(REWARDS)
    expected = [(r - 2.5) / (sb + 1e-4) for r in REWARDS[:4]] + [(r - 11.0) / (sb + 1e-4) for r in REWARDS[4:]]
    _check(adv, expected)


def test_group_advantages_no_scaling_and_interleaved_groups():
    # groups need not be contiguous
    rewards = [1.0, 10.0, 3.0, 14.0]
    adv = group_advantages(torch.tensor(rewards), torch.tensor([0, 1, 0, 1]), "none")
    _check(adv, [-1.0, -2.0, 1.0, 2.0])


def test_nan_rewards_get_zero_advantage_and_do_not_enter_statistics():
    rewards = [1.0, NAN, 3.0, 5.0, NAN, NAN, NAN, NAN]
    groups = [0, 0, 0, 0, 1, 1, 1, 1]
    for mode in ("group", "batch"):
        adv = group_advantages(torch.tensor(rewards), torch.tensor(groups), mode)
        std = _pop_std([1.0, 3.0, 5.0])  # group 0 valid rewards == all valid rewards
        _check(adv, [-2.0 / (std + 1e-4), 0.0, 0.0, 2.0 / (std + 1e-4), 0.0, 0.0, 0.0, 0.0])
        assert not bool(torch.isnan(adv).any())
    # a group with a single valid reward has nothing to compare with: advantage 0
    adv = group_advantages(torch.tensor([NAN, 7.0, 1.0, 2.0]), torch.tensor([0, 0, 1, 1]), "group")
    _check(adv, [0.0, 0.0, -0.5 / (0.5 + 1e-4), 0.5 / (0.5 + 1e-4)])


def test_baseline_mask_takes_statistics_from_the_masked_samples_only():
    # group 0: baseline samples 1, 3, 5 (mean 3, pop std sqrt(8/3)); sample 9 is scored against them
    rewards = torch.tensor([1.0, 3.0, 5.0, 9.0, 2.0, 4.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1])
    base = torch.tensor([True, True, True, False, True, True])
    s0 = math.sqrt(8 / 3)
    adv = group_advantages(rewards, groups, "group", clip=None, baseline=base)
    _check(adv, [-2 / (s0 + 1e-4), 0.0, 2 / (s0 + 1e-4), 6 / (s0 + 1e-4), -1 / (1 + 1e-4), 1 / (1 + 1e-4)])
    # the fresh samples' advantages are those of the group without the masked-out sample
    alone = group_advantages(rewards[base], groups[base], "group", clip=None)
    _check(adv[base], alone.tolist())
    # batch std from the baseline samples too; an all-True mask is the default
    adv = group_advantages(rewards, groups, "batch", clip=None, baseline=base)
    sb = _pop_std([1.0, 3.0, 5.0, 2.0, 4.0])
    _check(adv, [(r - m) / (sb + 1e-4) for r, m in zip(rewards.tolist(), [3, 3, 3, 3, 3, 3])])
    _check(group_advantages(rewards, groups, "group", baseline=torch.ones(6, dtype=torch.bool)),
           group_advantages(rewards, groups, "group").tolist())
    # group std with equal baseline rewards: the std of the whole group scales it, not eps (which gave +-clip);
    # one outsider in a group of 4 gets G / sqrt(G - 1), its baseline samples 0
    adv = group_advantages(torch.tensor([0.5, 0.5, 0.5, 1.0]), torch.zeros(4, dtype=torch.long), "group",
                           baseline=torch.tensor([True, True, True, False]))
    _check(adv, [0.0, 0.0, 0.0, 0.5 / (_pop_std([0.5, 0.5, 0.5, 1.0]) + 1e-4)])
    assert abs(float(adv[3]) - 4 / math.sqrt(3)) < 2e-3  # eps 1e-4 in the denominator
    # without a mask an all-equal group still gets 0
    _check(group_advantages(torch.tensor([0.5, 0.5]), torch.zeros(2, dtype=torch.long), "group"), [0.0, 0.0])
    # a group whose only baseline samples have no reward gets 0
    adv = group_advantages(torch.tensor([NAN, 5.0, 1.0, 2.0]), torch.tensor([0, 0, 1, 1]), "none",
                           baseline=torch.tensor([True, False, True, True]))
    _check(adv, [0.0, 0.0, -0.5, 0.5])


def test_advantages_are_clipped():
    adv = group_advantages(torch.tensor([0.0, 100.0, 3.0, 4.0]), torch.tensor([0, 0, 1, 1]), "none")
    _check(adv, [-5.0, 5.0, -0.5, 0.5])
    adv = group_advantages(torch.tensor([0.0, 100.0]), torch.tensor([0, 0]), "none", clip=None)
    _check(adv, [-50.0, 50.0])
    # group scaling with one outlier in a group of 8: (7/8) / sqrt(7/64) = 2.6458 -> clipped to 2
    r = torch.tensor([0.0] * 7 + [1.0])
    adv = group_advantages(r, torch.zeros(8, dtype=torch.long), "group", clip=2.0)
    assert float(adv[-1]) == 2.0
    assert float(adv[0]) == pytest.approx(-(1 / 8) / (math.sqrt(7 / 64) + 1e-4), rel=1e-6)


def test_constant_group_gives_zero_advantage_and_invalid_mode_raises():
    adv = group_advantages(torch.tensor([3.0, 3.0, 3.0]), torch.tensor([0, 0, 0]), "group")
    _check(adv, [0.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="scale_rewards"):
        group_advantages(torch.tensor([1.0, 2.0]), torch.tensor([0, 0]), "x")


def test_normalize_jointly_by_hand():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 100.0], [0.0, 1.0, 2.0], [2.0, 3.0, 4.0]])
    valid = torch.tensor([[True, True, True], [True, True, False], [True, False, True], [True, True, False]])
    groups = torch.tensor([0, 0, 1, 1])
    out = normalize_jointly(values, valid, groups)
    expected = [[0.0] * 3 for _ in range(4)]
    for rows in ([0, 1], [2, 3]):
        sel = [(i, k) for i in rows for k in range(3) if valid[i, k]]
        xs = [float(values[i, k]) for i, k in sel]
        m, s = sum(xs) / len(xs), _pop_std(xs)
        for i, k in sel:
            expected[i][k] = (float(values[i, k]) - m) / (s + 1e-4)
    _check(out, expected, tol=1e-5)
    # invalid pairs are 0 and do not influence the statistics (the 100 is masked)
    assert float(out[1, 2]) == 0.0
    # joint (not per-step) normalisation: the statistics span all steps of the group
    assert float(out[0, 0]) == pytest.approx((1.0 - 3.0) / (_pop_std([1, 2, 3, 4, 5]) + 1e-4), rel=1e-5)
