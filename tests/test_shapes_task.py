"""Tests of the shapes task (trl_flow.tasks.shapes): grammar, renderer, detector/rewards, base checkpoint."""

import os

import numpy as np
import pytest
import torch

from trl_flow.tasks import shapes
from trl_flow.tasks.shapes import grammar, model, reward
from trl_flow.tasks.shapes.render import render, render_batch


# ------------------------------------------------------------------------------------------------- grammar


def test_grammar_round_trip_and_sizes():
    specs = grammar.all_specs()
    counts = {c: sum(s.category == c for s in specs) for c in grammar.CATEGORIES}
    assert counts == {"single": 9, "colors": 36, "counting": 18, "two_objects": 36, "position": 288}
    prompts = [p for p, _ in grammar.all_prompts()]
    assert len(set(prompts)) == len(prompts)
    for spec in specs:
        text = spec.to_prompt()
        parsed = grammar.parse_prompt(text)
        assert parsed == spec and parsed.category == spec.category
        assert parsed.to_prompt() == text
    assert len(grammar.all_specs(max_count=3)) == 387 + 9
    for p, _ in grammar.all_prompts(max_count=4):
        assert grammar.parse_prompt(p).to_prompt() == p


def test_parse_examples_and_errors():
    spec = grammar.parse_prompt("a red circle to the left of a blue square")
    assert spec.category == "position" and spec.relation == "left"
    assert [(o.color, o.shape, o.count) for o in spec.objects] == [("red", "circle", 1), ("blue", "square", 1)]
    assert grammar.parse_prompt("two green triangles").objects[0] == grammar.ObjectSpec("green", "triangle", 2)
    assert grammar.parse_prompt("one green triangle").category == "counting"
    assert grammar.parse_prompt("a red circle").category == "single"
    assert grammar.parse_prompt("a red square and a green circle").category == "colors"
    assert grammar.parse_prompt("a red square and a red circle").category == "two_objects"
    assert grammar.parse_prompt("a red circle below a red square").relation == "below"
    for bad in ["a purple circle", "two green triangle", "a red circle and a red circle", "a red circle near a cat",
                "", "a red"]:
        with pytest.raises(ValueError):
            grammar.parse_prompt(bad)


def test_split_fixed_disjoint_and_held_out_by_combination():
    train, test = grammar.train_prompts(), grammar.test_prompts()
    assert set(train.column_names) == {"prompt", "category"} == set(test.column_names)
    assert not set(train["prompt"]) & set(test["prompt"])
    assert len(train) + len(test) == len(grammar.all_prompts())
    assert set(train["category"]) == set(test["category"]) == set(grammar.CATEGORIES)
    assert (len(train), len(test)) == (278, 109)
    assert list(grammar.test_prompts()["prompt"]) == list(test["prompt"])  # deterministic
    # no training prompt shows a held-out pair of (colour, shape) combinations together
    held = grammar.held_out_pairs()
    for p in train["prompt"]:
        objs = grammar.parse_prompt(p).objects
        if len(objs) == 2:
            assert tuple(sorted([objs[0].combo, objs[1].combo])) not in held
    for p, c in zip(test["prompt"], test["category"]):
        objs = grammar.parse_prompt(p).objects
        if c in ("colors", "two_objects", "position"):
            assert tuple(sorted([objs[0].combo, objs[1].combo])) in held


# ------------------------------------------------------------------------------------- renderer and reward


def _sample_prompts(n, seed):
    rng = np.random.default_rng(seed)
    allp = grammar.all_prompts()
    return [allp[i][0] for i in rng.integers(0, len(allp), n)]


def test_render_shapes_and_dtypes():
    img = render("two green triangles", rng=0)
    assert img.shape == (3, 32, 32) and img.dtype == np.uint8
    f = render("a red circle to the left of a blue square", rng=np.random.default_rng(1), dtype="float32")
    assert f.dtype == np.float32 and f.min() >= 0 and f.max() <= 1
    assert np.array_equal(render("a red circle", rng=5), render("a red circle", rng=5))
    assert render("a red circle", rng=0, size=64, grid=1).shape == (3, 64, 64)


def test_detector_agrees_with_renderer_and_rejects_noise():
    prompts = _sample_prompts(300, seed=0)
    images = render_batch(prompts, rng=1)  # (300, 3, 32, 32) in [0, 1]
    strict = shapes.shapes_strict_reward(images, prompts)
    assert np.mean(strict) >= 0.98
    # what the pipeline's VAE keeps (2x2 average pool, nearest upsample) is scored the same
    pooled = torch.nn.functional.interpolate(torch.nn.functional.avg_pool2d(images, 2), scale_factor=2)
    assert np.mean(shapes.shapes_strict_reward(pooled, prompts)) >= 0.98
    # full-resolution drawings and other sizes also pass
    full = render_batch(prompts[:100], rng=2, size=32, grid=1)
    assert np.mean(shapes.shapes_strict_reward(full, prompts[:100])) >= 0.98
    # uniform noise: about 0
    noise = torch.rand(300, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    assert np.mean(shapes.shapes_strict_reward(noise, prompts)) <= 0.02
    partial = shapes.shapes_partial_reward(noise, prompts)
    assert all(0.0 <= p <= 1.0 for p in partial) and np.mean(partial) < 0.2
    # an image drawn for another prompt rarely passes, but gets partial credit
    shuffled = images[torch.roll(torch.arange(300), 1)]
    assert np.mean(shapes.shapes_strict_reward(shuffled, prompts)) < 0.1
    partial = shapes.shapes_partial_reward(shuffled, prompts)
    assert all(0.0 <= p <= 1.0 for p in partial) and 0.1 < np.mean(partial) < 0.8


def test_score_partial_credit_and_relation():
    img = render("a red circle to the left of a blue square", rng=3)
    assert reward.score(img, "a red circle to the left of a blue square") == {"strict": 1.0, "partial": 1.0}
    swapped = reward.score(img, "a red circle to the right of a blue square")
    assert swapped["strict"] == 0.0 and swapped["partial"] == 9 / 10
    s = reward.score(render("a red circle", rng=0), "two red circles")
    assert s["strict"] == 0.0 and s["partial"] == 1 / 5  # only "a red circle is present"
    assert reward.relations_between((0, 10, 5, 15), (20, 10, 25, 15)) == {"left"}
    assert reward.relations_between((10, 0, 15, 5), (10, 20, 15, 25)) == {"above"}
    assert reward.relations_between((0, 0, 5, 5), (1, 1, 6, 6)) == set()
    # accepts uint8 CHW, float HWC and PIL
    from PIL import Image

    pil = Image.fromarray(img.transpose(1, 2, 0))
    assert reward.score(pil, "a red circle to the left of a blue square")["strict"] == 1.0
    assert reward.score(img.transpose(1, 2, 0) / 255.0, "a red circle to the left of a blue square")["strict"] == 1.0


def test_failure_kind_names_the_first_failing_group():
    prompt = "a red circle to the left of a blue square"
    img = render(prompt, rng=3)
    objects = reward.detect(img)
    assert reward.failure_kind(objects, prompt) == "ok"
    assert reward.failure_kind(objects, "a red circle to the right of a blue square") == "relation"
    assert reward.failure_kind(objects, "a red triangle to the left of a blue square") == "shape"
    assert reward.failure_kind(objects, "a green circle to the left of a blue square") == "colour"
    assert reward.failure_kind(reward.detect(render("a red circle", rng=0)), prompt) == "count"
    # the groups flatten to constraints_met, in its order, for every category
    for p in ["two green triangles", "a red square and a green circle", prompt, "a blue circle below a red circle"]:
        for q in [p, "a red circle", "a red circle and a blue square"]:
            objs = reward.detect(render(q, rng=5))
            groups = reward.constraint_groups(objs, grammar.parse_prompt(p))
            assert list(groups) == ["colour", "shape", "count", "relation"]
            assert [ok for g in groups.values() for ok in g] == reward.constraints_met(objs, grammar.parse_prompt(p))
            assert (reward.failure_kind(objs, p) == "ok") == bool(reward.score(render(q, rng=5), p)["strict"])


def test_reward_callables_follow_contract():
    prompts = ["a red circle", "two blue squares", "a green triangle above a red square"]
    images = render_batch(prompts, rng=0)
    assert images.dtype == torch.float32 and images.shape == (3, 3, 32, 32)
    for fn in (shapes.shapes_partial_reward, shapes.shapes_strict_reward):
        out = fn(images, prompts, category=["single", "counting", "position"], metadata=[{}, {}, {}], step=[1, 1, 1])
        assert isinstance(out, list) and len(out) == 3 and all(isinstance(v, float) for v in out)
        assert out == [1.0, 1.0, 1.0]
        assert isinstance(fn.__name__, str) and fn.__name__
    assert shapes.shapes_partial_reward.__name__ != shapes.shapes_strict_reward.__name__
    clean = shapes.shape_cleanliness(images)
    assert isinstance(clean, list) and len(clean) == 3 and clean == [1.0, 1.0, 1.0]
    gray = torch.full((2, 3, 32, 32), 0.5)
    assert shapes.shape_cleanliness(gray) == [0.0, 0.0]
    with pytest.raises(ValueError):
        shapes.shapes_strict_reward(images, prompts[:2])


def test_evaluate_per_category():
    prompts = _sample_prompts(60, seed=4)
    images = render_batch(prompts, rng=4)
    result = shapes.evaluate(images, prompts, [grammar.parse_prompt(p).category for p in prompts])
    assert result["overall"]["strict"] == 1.0 and result["overall"]["n"] == 60
    assert set(result) - {"overall"} <= set(grammar.CATEGORIES)
    for name, r in result.items():
        extra = {"relation", "n_relation"} if name in ("overall", "position") else set()
        assert set(r) == {"strict", "partial", "cleanliness", "n"} | extra, name
        assert r.get("relation", 1.0) == 1.0  # rendered ground truth stands in every asked relation
    assert shapes.evaluate(images, prompts)["overall"]["partial"] == 1.0  # categories parsed when omitted


# --------------------------------------------------------------------------------------- model components


def test_tokenizer_one_token_per_word_and_vae_round_trip():
    tok = model.build_tokenizer()
    for word in grammar.VOCABULARY:
        assert len(tok.tokenize(word)) == 1, word
    ids = tok("a green triangle to the right of a green square", padding="max_length",
              max_length=model.TOKENIZER_MAX_LENGTH).input_ids
    assert len(ids) == model.TOKENIZER_MAX_LENGTH and ids[0] == tok.bos_token_id and ids[11] == tok.eos_token_id
    vae = model.build_vae()
    x = render_batch(_sample_prompts(8, 5), rng=5) * 2 - 1  # (8, 3, 32, 32) in [-1, 1]
    with torch.no_grad():
        z = vae.encode(x).latent_dist.sample()
        assert z.shape == (8, 3, 16, 16)
        assert (z - torch.nn.functional.avg_pool2d(x, 2)).abs().max() < 1e-5
        assert (vae.decode(z).sample - x).abs().max() < 1e-5


# ------------------------------------------------------------------------------------------ base checkpoint


@pytest.fixture(scope="module")
def base_pipe():
    torch.set_num_threads(min(2, torch.get_num_threads()))
    return model.load_base_pipeline()


def test_base_checkpoint_small_and_configured():
    total = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(model.BASE_MODEL_DIR) for f in fs)
    assert total < 8 * 2**20
    assert os.path.exists(os.path.join(model.BASE_MODEL_DIR, "model_index.json"))


def test_base_pipeline_loads_and_generates(base_pipe):
    import diffusers

    pipe = base_pipe
    assert isinstance(pipe, diffusers.StableDiffusion3Pipeline)
    assert pipe.text_encoder_3 is None and pipe.tokenizer_3 is None
    for name in ("transformer", "vae", "text_encoder", "text_encoder_2"):
        assert not getattr(pipe, name).training, name
    assert pipe.scheduler.config.shift == model.BASE_SHIFT
    assert pipe.tokenizer.model_max_length == model.TOKENIZER_MAX_LENGTH
    # the saved tokenizers are the word-level ones
    fresh = model.build_tokenizer()
    prompt = "a red circle to the left of a blue square"
    assert pipe.tokenizer(prompt).input_ids == fresh(prompt).input_ids == pipe.tokenizer_2(prompt).input_ids
    out = pipe("a red circle", height=32, width=32, num_inference_steps=2, guidance_scale=model.DEFAULT_GUIDANCE_SCALE,
               max_sequence_length=model.MAX_SEQUENCE_LENGTH, generator=torch.Generator().manual_seed(0))
    assert out.images[0].size == (32, 32)
    out = pipe("two green triangles", height=32, width=32, num_inference_steps=2, guidance_scale=1.0,
               output_type="pt")
    assert out.images.shape == (1, 3, 32, 32)
    images = model.generate(pipe, ["a red circle", "two blue squares"], seed=0, num_inference_steps=4)
    assert images.shape == (2, 3, 32, 32) and images.min() >= 0 and images.max() <= 1
    rewards = shapes.shapes_partial_reward(images, ["a red circle", "two blue squares"])
    assert len(rewards) == 2 and all(0 <= r <= 1 for r in rewards)


# ------------------------------------------------------------------------------------ RL split, dense reward


def test_val_split_is_held_out_from_rl_training_and_disjoint_from_test():
    train = set(grammar.train_prompts()["prompt"])
    rl, val, test = (
        set(d["prompt"]) for d in (grammar.rl_train_prompts(), grammar.val_prompts(), grammar.test_prompts()))
    assert rl | val == train and not rl & val and not val & test and not rl & test
    assert 0.1 < len(val) / len(train) < 0.3  # VAL_FRACTION = 0.2 of the train split, by md5 rank
    pos = grammar.rl_train_prompts(categories=("position",))
    assert set(pos["category"]) == {"position"} and set(pos["prompt"]) <= rl
    assert list(grammar.val_prompts()["prompt"]) == list(grammar.val_prompts()["prompt"])  # deterministic


def test_dense_reward_is_graded_and_agrees_with_the_detector():
    rng = np.random.default_rng(0)
    prompts = [p for p, _ in grammar.all_prompts()][::7]
    images = render_batch(prompts, rng=rng)
    dense = np.array(shapes.shapes_dense_reward(images, prompts))
    assert dense.min() > 0.85  # rendered ground truth: every soft constraint close to 1
    shuffled = prompts[1:] + prompts[:1]
    d_wrong = np.array(shapes.shapes_dense_reward(images, shuffled))
    p_wrong = np.array(shapes.shapes_partial_reward(images, shuffled))
    assert d_wrong.mean() < dense.mean() - 0.3
    assert np.corrcoef(d_wrong, p_wrong)[0, 1] > 0.9  # the same constraints, graded
    assert np.mean(shapes.shapes_dense_reward(torch.rand_like(images), prompts)) < 0.3
    # graded: eroding a rendered square pixel by pixel lowers the dense score step by step, while the
    # detector's partial score stays constant until a threshold flips
    img = render("a red square", np.random.default_rng(1))
    img = torch.as_tensor(img).float()
    if img.shape[0] != 3:
        img = img.permute(2, 0, 1)
    mask = img[0] > 0.5
    ys, xs = torch.nonzero(mask, as_tuple=True)
    scores = []
    for n in range(0, 13, 3):  # blacken n pixels of the square's top row
        x = img.clone()
        for i in range(n):
            x[:, ys.min(), xs.min() + i] = 0
        scores.append(reward.dense_score(x, "a red square"))
    assert all(a > b for a, b in zip(scores, scores[1:])), scores


def test_relation_reward_weights_the_relation_half_and_keeps_the_shape_terms():
    rng = np.random.default_rng(3)
    pos = [p for p, c in grammar.all_prompts() if c == "position"][::5]
    images = render_batch(pos, rng=rng)
    flip = {"left": "right", "right": "left", "above": "below", "below": "above"}
    flipped = []
    for p in pos:
        rel = grammar.parse_prompt(p).relation
        word = {"left": "to the left of", "right": "to the right of", "above": "above", "below": "below"}
        flipped.append(p.replace(word[rel], word[flip[rel]]))
    rel_ok = np.array(shapes.shapes_relation_reward(images, pos))
    rel_bad = np.array(shapes.shapes_relation_reward(images, flipped))
    dense_ok = np.array(shapes.shapes_dense_reward(images, pos))
    dense_bad = np.array(shapes.shapes_dense_reward(images, flipped))
    assert rel_ok.min() > 0.8
    # a wrong relation costs about half the relation reward, a tenth of the dense reward
    assert (rel_ok - rel_bad).mean() > 0.4 and (dense_ok - dense_bad).mean() < 0.15
    # 0.5 * relation + 0.5 * mean(other terms), with the other terms those of the dense score
    for img, p in zip(images[:4], pos[:4]):
        full, r0, r1 = (reward.dense_score(img, p, relation_weight=w) for w in (None, 0.0, 1.0))
        assert reward.dense_score(img, p, relation_weight=0.5) == pytest.approx(0.5 * r0 + 0.5 * r1)
        # the dense score averages n terms, the relation one (n = 10 for two colours and two shapes, fewer shared)
        assert any(full == pytest.approx(((n - 1) * r0 + r1) / n) for n in (8, 9, 10)), (full, r0, r1)
    # the shape terms stay in: the right relation between a wrong shape scores below the right one
    wrong_shape = [p.replace("circle", "CIRCLE").replace("square", "circle").replace("CIRCLE", "square") for p in pos]
    changed = [i for i, (a, b) in enumerate(zip(pos, wrong_shape)) if a != b]
    assert changed and (
        np.array(shapes.shapes_relation_reward(images, wrong_shape))[changed] < rel_ok[changed] - 0.1).all()
    # prompts without a relation: exactly the dense reward
    plain = [p for p, c in grammar.all_prompts() if c == "colors"][:6]
    im2 = render_batch(plain, rng=rng)
    assert shapes.shapes_relation_reward(im2, plain) == shapes.shapes_dense_reward(im2, plain)
    for prompt in (pos[0], plain[0]):  # refused with or without a relation in the prompt
        with pytest.raises(ValueError, match="relation_weight"):
            reward.dense_score(images[0], prompt, relation_weight=1.5)


# ------------------------------------------------------------------------ caption noise, noisy-caption base


def test_noisy_caption_flips_at_the_given_rates_and_is_seeded():
    pos = [p for p, c in grammar.all_prompts() if c == "position"]
    col = [p for p, c in grammar.all_prompts() if c == "colors"]
    one = [p for p, c in grammar.all_prompts() if c in ("single", "counting")]
    n = 3000
    for prompts, kwargs, kind in [(pos, {"flip_relation": 0.3}, "relation"), (col, {"swap_colors": 0.25}, "colors"),
                                  (one, {"count_off": 0.4}, "count")]:
        rate = next(iter(kwargs.values()))
        rng = np.random.default_rng(0)
        flipped = 0
        for i in range(n):
            p = prompts[i % len(prompts)]
            cap, errors = grammar.noisy_caption(p, rng, **kwargs)
            spec, got = grammar.parse_prompt(p), grammar.parse_prompt(cap)  # every caption is in the grammar
            assert errors in ((), (kind,))
            if not errors:
                assert cap == p
                continue
            flipped += 1
            if kind == "relation":
                assert got.objects == spec.objects and got.relation == grammar.OPPOSITE_RELATION[spec.relation]
            elif kind == "colors":
                a, b = spec.objects
                assert [o.combo for o in got.objects] == [(b.color, a.shape), (a.color, b.shape)]
            else:
                assert got.objects[0].combo == spec.objects[0].combo
                assert abs(got.objects[0].count - spec.objects[0].count) == 1 and got.category == "counting"
        assert abs(flipped / n - rate) < 0.03, (kind, flipped / n)
    # seeded: the same generator seed gives the same captions; probability 0 is the identity
    a = [grammar.noisy_caption(p, np.random.default_rng(5), 0.5, 0.5, 0.5) for p in pos[:50]]
    b = [grammar.noisy_caption(p, np.random.default_rng(5), 0.5, 0.5, 0.5) for p in pos[:50]]
    assert a == b
    rng = np.random.default_rng(1)
    assert all(grammar.noisy_caption(p, rng) == (p, ()) for p in pos + col + one)
    # swapping colours is a no-op in meaning for "a red circle and a blue circle": left alone
    assert grammar.noisy_caption("a red circle and a blue circle", rng, swap_colors=1.0) == (
        "a red circle and a blue circle", ())


def _script(name: str = "pretrain_shapes"):
    """scripts/<name>.py as a module."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_pretrain_script_captions_with_noise_and_never_names_a_test_prompt():
    mod = _script()
    weights = {"position": 1.0}
    images, cap_idx, captions, stats = mod.render_data(400, weights, seed=0, flip_relation=0.5)
    clean_images, clean_idx, prompts, none = mod.render_data(400, weights, seed=0)
    assert none == {} and np.array_equal(images, clean_images)  # same images, only the captions change
    test = set(grammar.test_prompts()["prompt"])
    assert not {captions[i] for i in cap_idx} & test
    changed = np.mean([captions[c] != prompts[i] for c, i in zip(cap_idx, clean_idx)])
    assert changed == stats["noisy"] / 400 and 0.4 < changed < 0.6
    args = mod.parse_args(["--init-from", model.BASE_MODEL_DIR, "--flip-relation-prob", "0.4",
                           "--swap-colors-prob", "0.1", "--count-off-prob", "0.2"])
    assert (args.init_from, args.flip_relation_prob, args.swap_colors_prob, args.count_off_prob) == (
        model.BASE_MODEL_DIR, 0.4, 0.1, 0.2)


def test_pretrain_script_trains_the_text_encoders_when_asked(tmp_path):
    import json

    mod = _script()
    out, state = str(tmp_path / "te"), str(tmp_path / "state.pt")
    n = torch.get_num_threads()
    try:
        mod.main(["--init-from", model.BASE_MODEL_DIR, "--out", out, "--steps", "3", "--warmup", "1", "--num-images",
                  "64", "--batch-size", "8", "--eval-per-category", "1", "--eval-steps", "2", "--eval-shifts", "3",
                  "--save", "raw", "--state", state, "--train-text-encoders", "--text-encoder-lr", "1e-2"])
    finally:
        torch.set_num_threads(n)
    info = json.load(open(os.path.join(out, "training_info.json")))
    assert info["train_text_encoders"] is True and info["text_encoder_lr"] == 1e-2 and info["steps"] == 3
    base, trained = model.load_base_pipeline(), model.load_base_pipeline(path=out)
    saved = torch.load(state)
    for name in ("transformer", "text_encoder", "text_encoder_2"):
        a, b = getattr(base, name).state_dict(), getattr(trained, name).state_dict()
        assert any(not torch.equal(a[k], b[k]) for k in a), name  # every trained module moved
        for k, v in getattr(trained, name).named_parameters():
            assert torch.equal(saved["raw"][f"{name}.{k}"], v), (name, k)  # --save raw wrote the raw weights
        assert not getattr(trained, name).training
    va, vb = base.vae.state_dict(), trained.vae.state_dict()
    assert all(torch.equal(va[k], vb[k]) for k in va)  # the hand-set VAE is never trained


def test_noisy_base_variant_loads_and_differs_only_in_the_transformer(base_pipe):
    import json

    assert set(model.BASE_MODEL_VARIANTS) == {"clean", "noisy"}
    d = model.NOISY_BASE_MODEL_DIR
    total = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(d) for f in fs)
    assert total < 8 * 2**20 and os.path.exists(os.path.join(d, "model_index.json"))
    info = json.load(open(os.path.join(d, "training_info.json")))
    assert "--steps" in info["command"] and "--init-from" in info["command"] and info["steps"] > 0
    noisy = model.load_base_pipeline(variant="noisy")
    for name in ("transformer", "vae", "text_encoder", "text_encoder_2"):
        assert not getattr(noisy, name).training, name
    assert noisy.scheduler.config.shift == model.BASE_SHIFT
    sd_a, sd_b = base_pipe.text_encoder.state_dict(), noisy.text_encoder.state_dict()
    assert all(torch.equal(sd_a[k], sd_b[k]) for k in sd_a)  # same frozen text encoders
    ta, tb = base_pipe.transformer.state_dict(), noisy.transformer.state_dict()
    assert any(not torch.equal(ta[k], tb[k]) for k in ta)  # fine-tuned transformer
    images = model.generate(noisy, ["a red circle to the left of a blue square"] * 2, seed=0, num_inference_steps=4)
    assert images.shape == (2, 3, 32, 32)
    with pytest.raises(ValueError, match="'nope'.*save_pretrained folder"):
        model.load_base_pipeline(variant="nope")
    # a folder as the variant (name or path, as from_pretrained) is the same as path=
    by_folder = model.load_base_pipeline(variant=d)
    tc = by_folder.transformer.state_dict()
    assert all(torch.equal(tb[k], tc[k]) for k in tb)


def test_corner_occupancy_separates_discs_from_soft_cornered_squares():
    def comp(mask):
        m = np.kron(np.asarray(mask, dtype=bool), np.ones((2, 2), dtype=bool))  # drawn on the VAE's 2x2 grid
        img = np.zeros((3, 32, 32), dtype=np.float32)
        img[0, 2 : 2 + m.shape[0], 2 : 2 + m.shape[1]] = m
        (o,) = reward.detect(img)
        return o

    full = np.ones((7, 7))
    assert comp(full)["shape"] == "square" and comp(full)["corner"] == 1.0
    soft = full.copy()
    soft[0, 0] = soft[-1, -1] = 0  # two corner cells missing: still a square
    assert comp(soft)["shape"] == "square"
    from trl_flow.tasks.shapes.render import shape_stamp

    for d in range(6, 10):  # every rendered disc stays a circle, every rendered triangle a triangle
        assert comp(shape_stamp("circle", d))["shape"] == "circle"
        assert comp(shape_stamp("circle", d))["corner"] < reward.SQUARE_CORNER - 0.05
        assert comp(shape_stamp("triangle", d))["shape"] == "triangle"
    rounded = np.ones((6, 6))
    for y, x in [(0, 0), (0, 5), (5, 0), (5, 5)]:
        rounded[y, x] = 0  # a 6x6 box without its four corner cells: the rendered disc of diameter 6
    assert comp(rounded)["shape"] == "circle" and comp(rounded)["corner"] < 0.56
    rounded7 = full.copy()
    for y, x in [(0, 0), (0, 6), (6, 0), (6, 6)]:
        rounded7[y, x] = 0  # a 7x7 box without its corner cells covers 3/4 of its 2x2-cell corner patches
    assert comp(rounded7)["shape"] == "square"


def test_dense_reward_grades_the_square_circle_decision_by_corner_occupancy():
    # a square drawn on the VAE's 2x2 grid loses its corner cells one by one (the order a disc rounds them):
    # the dense score of "a red square" never rises and falls through the detector's corner threshold, the score
    # of "a red circle" rises, and the hard detector flips from square to circle where the soft decision crosses
    d = 8
    order = [(0, 0), (0, d - 1), (d - 1, 0), (d - 1, d - 1), (0, 1), (1, 0), (0, d - 2), (1, d - 1), (d - 1, 1),
             (d - 2, 0), (d - 1, d - 2), (d - 2, d - 1)]
    sq, ci, read = [], [], []
    for k in range(len(order) + 1):
        m = np.ones((d, d), dtype=bool)
        for y, x in order[:k]:
            m[y, x] = False
        img = np.zeros((3, 32, 32), dtype=np.float32)
        img[0, 4 : 4 + 2 * d, 4 : 4 + 2 * d] = np.kron(m, np.ones((2, 2)))
        sq.append(reward.dense_score(img, "a red square"))
        ci.append(reward.dense_score(img, "a red circle"))
        read.append(reward.detect(img)[0]["shape"])
    assert all(a >= b - 1e-9 for a, b in zip(sq, sq[1:])) and sq[0] > 0.99 and sq[-1] < 0.45, sq
    assert all(a > b for a, b in zip(sq[3:9], sq[4:9])), sq  # strictly graded around the threshold
    assert ci[8] > ci[4] + 0.5 and ci[0] < 0.45, ci
    flip = read.index("circle")
    assert set(read[:flip]) == {"square"} and set(read[flip:]) == {"circle"}
    assert sq[flip - 1] >= ci[flip - 1] - 1e-6 and sq[flip] < ci[flip]


def test_colour_relation_check_reads_the_relation_of_the_two_colours_and_evaluate_reports_it():
    from trl_flow.tasks.shapes import render_batch, reward

    left, right = "a red circle to the left of a blue square", "a red circle to the right of a blue square"
    imgs = render_batch([left] * 4, rng=0)
    assert all(reward.colour_relation_holds(img, left) for img in imgs)
    assert not any(reward.colour_relation_holds(img, right) for img in imgs)
    assert reward.colour_relation_holds(imgs[0], "a red circle above a red square") is None  # one colour
    assert reward.colour_relation_holds(imgs[0], "a red circle") is None  # no relation
    assert reward.colour_relation_holds(imgs[0] * 0, left) is False  # a colour missing
    res = reward.evaluate(imgs, [left, left, right, "a red circle"])
    assert res["overall"]["relation"] == 2 / 3 and res["overall"]["n_relation"] == 3
    assert "relation" not in res["single"] and res["position"]["n_relation"] == 3


def test_position_failures_share_out_every_sample(base_pipe):
    mod = _script("measure_shapes_bases")
    out = mod.position_failures(base_pipe, grammar.val_prompts(), n=16)
    kinds = out["kinds"]
    assert list(kinds) == list(reward.FAILURE_KINDS) and out["n"] == 16
    assert sum(kinds.values()) == pytest.approx(1.0)
    assert all(v * 16 == pytest.approx(round(v * 16)) for v in kinds.values())
    assert 0.0 <= out["relation"] <= 1.0 and 0 < out["n_relation"] <= 16
    # the clean base draws the relation right (0.97 in docs/shapes.md): relation-only failures are rare
    assert out["relation"] > 0.7 and kinds["relation"] < 0.3


def test_pretraining_schedule_update_and_timed_loop(capsys):
    """trl_flow.tasks.shapes.pretraining (shared by both pretraining scripts): warm-up then cosine to 0, per-group
    peak rates, the update with its EMA, and a timed run whose first steps count toward its total."""
    import math

    from trl_flow.tasks.shapes import pretraining as pt

    assert [pt.lr_at(s, 10, 4) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert pt.lr_at(4, 10, 4) == 1.0 and pt.lr_at(7, 10, 4) == 0.5 * (1 + math.cos(math.pi * 0.5))
    assert pt.lr_at(10, 10, 4) == 0.0 and pt.lr_at(50, 10, 4) == 0.0
    w = torch.nn.Parameter(torch.ones(3))
    v = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([{"params": [w], "lr": 0.1}, {"params": [v], "lr": 0.1, "peak_lr": 0.4}], lr=0.1)
    pt.set_lr(opt, 1, 10, 4)
    pt.set_lr(opt, 1, 10, 4)  # idempotent: the peak is kept, not the last rate
    assert [g["lr"] for g in opt.param_groups] == [0.1 * 0.5, 0.4 * 0.5]
    ema = [w.detach().clone(), v.detach().clone()]
    loss = pt.optimizer_step(opt, [w, v], ema, 0.9, (w ** 2).sum() + (v ** 2).sum())
    c = 2 / math.sqrt(5 * 2 ** 2)  # every gradient is 2, clipped to a total norm of 1
    assert loss == 5.0 and torch.allclose(w, torch.full((3,), 1 - 0.05 * c)) and torch.allclose(v,
        torch.full((2,), 1 - 0.2 * c))
    assert torch.allclose(ema[0], 0.9 + 0.1 * w.detach()) and torch.allclose(ema[1], 0.9 + 0.1 * v.detach())
    seen = []
    total, losses, _ = pt.run_steps(lambda s, t: seen.append((s, t)) or float(s), 5, 1.0, batch_size=1, threads=1,
                                    log_every=2, lr_now=lambda: 0.0)
    assert total == 5 and losses == [0.0, 1.0, 2.0, 3.0, 4.0] and seen == [(s, 5) for s in range(5)]
    seen.clear()
    total, losses, _ = pt.run_steps(lambda s, t: seen.append((s, t)) or 0.0, None, 0.0005, batch_size=1, threads=1,
                                    log_every=10**6, lr_now=lambda: 0.0, calib=12)
    assert [s for s, _ in seen] == list(range(len(seen))) and len(losses) == total == len(seen) >= 12
    assert all(t == 10**9 for _, t in seen[:12]) and all(t == total for _, t in seen[12:])
    assert f"--steps {total}" in capsys.readouterr().out


# ------------------------------------------------------------------------------------ update-batch layout
def test_default_layout_mixes_prompts_in_every_microbatch_and_keeps_first_ratio_one(tmp_path):
    """FlowGRPOConfig()'s batch defaults (4 prompts x 8, microbatch 8) on the shapes task: every update microbatch
    holds samples of several prompts (``batch_layout="mixed"``), and the first pass still recomputes the rollout's
    log-probs bit for bit. ``by_prompt`` gives one prompt per microbatch at these sizes."""
    from trl_flow import FlowGRPOConfig, FlowGRPOTrainer

    prompts = grammar.train_prompts()["prompt"][:16]
    logs = {}
    for layout in ("mixed", "by_prompt"):
        cfg = FlowGRPOConfig(output_dir=str(tmp_path / layout), height=32, width=32, max_steps=2,
                             num_inference_steps=4,
                             max_sequence_length=model.MAX_SEQUENCE_LENGTH,
                             guidance_scale=model.DEFAULT_GUIDANCE_SCALE,
                             batch_layout=layout, disable_tqdm=True)
        assert (cfg.prompts_per_step, cfg.num_generations, cfg.per_device_train_batch_size) == (4, 8, 8)
        trainer = FlowGRPOTrainer(cfg, model.load_base_pipeline(), [shapes.shapes_partial_reward],
                                  train_dataset=list(prompts))
        trainer.train()
        logs[layout] = trainer.state.log_history
    for entry in logs["mixed"]:
        assert entry["prompts_per_microbatch"] >= 2
        assert entry["ratio_first_max_dev"] == 0.0
    assert [e["prompts_per_microbatch"] for e in logs["by_prompt"]] == [1.0, 1.0]
