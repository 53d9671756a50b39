"""A TRL user's call forms and names: TRL's trainer keywords (model=, args=, peft_config=), TRL's GRPOConfig names
(epsilon, num_iterations) in Python, recipes and on the command line, and the sampling settings a model carries."""

from __future__ import annotations

import json
import warnings

import pytest

from conftest import HEIGHT, MAX_SEQ, PROMPTS, WIDTH, brightness, tiny_config
from trl_flow import DiffusionNFTConfig, FlowGRPOConfig, FlowGRPOTrainer, OPGRPOConfig, OPGRPOTrainer, cli
from trl_flow.trainers import trl_compat


# ------------------------------------------------------------------------------------------- config names
def test_trl_names_set_our_fields_in_python():
    config = FlowGRPOConfig(num_iterations=2, epsilon=0.2)
    assert (config.num_inner_epochs, config.clip_range) == (2, 0.2)
    assert not hasattr(config, "num_iterations") and not hasattr(config, "epsilon")
    assert FlowGRPOConfig(scale_rewards=True).scale_rewards == "group"  # TRL's bool form
    assert FlowGRPOConfig(scale_rewards=False).scale_rewards == "none"
    assert OPGRPOConfig(num_iterations=3).num_inner_epochs == 3  # every config class


def test_trl_names_are_checked_like_ours():
    with pytest.raises(ValueError, match="num_inner_epochs=0"):
        FlowGRPOConfig(num_iterations=0)
    with pytest.raises(ValueError, match="pass only clip_range"):
        FlowGRPOConfig(epsilon=0.2, clip_range=0.1)
    with pytest.raises(ValueError, match="epsilon_high.*clip_range"):
        FlowGRPOConfig(epsilon_high=0.3)
    with pytest.raises(ValueError, match="num_train_epochs.*max_steps"):
        FlowGRPOConfig(num_train_epochs=3)


def test_a_config_without_the_field_refuses_the_trl_name_saying_why():
    with pytest.raises(ValueError, match="DiffusionNFTConfig does not have.*no log-prob ratio to clip"):
        DiffusionNFTConfig(epsilon=0.2)
    assert DiffusionNFTConfig(num_iterations=2).num_inner_epochs == 2


def test_trl_names_on_the_command_line_and_in_recipes(tmp_path, capsys):
    _, config, _ = cli.parse_args("grpo", ["--num_iterations", "2", "--epsilon=0.01"])
    assert (config.num_inner_epochs, config.clip_range) == (2, 0.01)
    err = capsys.readouterr().err
    assert "--num_iterations is TRL's name for --num_inner_epochs" in err and "--clip_range" in err
    recipe = tmp_path / "r.yaml"
    recipe.write_text("num_iterations: 3\n")
    _, config, _ = cli.parse_args("grpo", ["--config", str(recipe)])
    assert config.num_inner_epochs == 3
    with pytest.raises(cli.CLIError, match=r"--epsilon is TRL's name for --clip_range.*no log-prob ratio"):
        cli.parse_args("nft", ["--epsilon", "0.2"])
    assert cli.main(["grpo", "--epsilon_high", "0.3"]) == 2
    assert "--epsilon_high is TRL's GRPOConfig option" in capsys.readouterr().err
    recipe.write_text("epsilon: 0.1\nclip_range: 0.2\n")
    with pytest.raises(cli.CLIError, match="keep clip_range"):
        cli.parse_args("grpo", ["--config", str(recipe)])


# ------------------------------------------------------------------------------------------ trainer call
def test_trl_keyword_form_trains(tmp_path, fresh_pipe):
    from peft import LoraConfig

    config = tiny_config(tmp_path, max_steps=1, lora_r=32, lora_alpha=64)  # LoRA fields at their defaults
    trainer = FlowGRPOTrainer(model=fresh_pipe(), reward_funcs=[brightness], args=config, train_dataset=PROMPTS,
                              peft_config=LoraConfig(r=2, lora_alpha=6, target_modules=["attn.to_q", "attn.to_k"]))
    assert (trainer.config.lora_r, trainer.config.lora_alpha) == (2, 6)
    assert trainer.config.lora_target_modules == ["attn.to_k", "attn.to_q"]  # peft keeps a set: sorted
    assert config.lora_r == 32  # the user's config object is left as it was
    before = [p.detach().clone() for p in trainer.trainable_params]
    assert all(p.shape[0] == 2 or p.shape[1] == 2 for p in before)  # rank 2 adapters
    trainer.train()
    assert trainer.state.global_step == 1
    assert any(not (a == p.detach()).all() for a, p in zip(before, trainer.trainable_params))


def test_trl_positional_form_and_ours_build_the_same_trainer(tmp_path, fresh_pipe):
    ours = FlowGRPOTrainer(tiny_config(tmp_path / "a"), fresh_pipe(), [brightness], PROMPTS)
    trl = FlowGRPOTrainer(fresh_pipe(), [brightness], tiny_config(tmp_path / "b"), PROMPTS)
    assert trl.config.num_generations == ours.config.num_generations and trl.reward_funcs == [brightness]
    assert len(trl.train_dataset) == len(ours.train_dataset)


def test_subclasses_take_the_trl_form(tmp_path, fresh_pipe):
    config = tiny_config(tmp_path, config_class=OPGRPOConfig)
    trainer = OPGRPOTrainer(model=fresh_pipe(), reward_funcs=brightness, args=config, train_dataset=PROMPTS)
    assert trainer.replay_buffer is not None and trainer.config is not None


def test_bad_call_forms_name_the_argument(tmp_path, fresh_pipe):
    config, pipe = tiny_config(tmp_path), fresh_pipe()
    base = dict(reward_funcs=[brightness], train_dataset=PROMPTS)
    cases = [
        (dict(config=config, args=config, pipe=pipe), "config is given twice"),
        (dict(config=config, model=pipe, pipe=pipe), "pipeline is given twice"),
        (dict(config=config, pipe=pipe, processing_class=object()), "processing_class: .*its own tokenizers"),
        (dict(config=config, pipe=pipe, optimizers=(None, None)), "optimizers: .*built from the config"),
        (dict(config=config, pipe=pipe, frobnicate=1), "unexpected keyword argument.*frobnicate"),
        (dict(args=config), "no pipeline; pass model=pipe"),
    ]
    for kwargs, match in cases:
        with pytest.raises(TypeError, match=match):
            FlowGRPOTrainer(**base, **kwargs)
    # TRL's model= may be a model id: it is loaded (offline here, so a missing one is named, before any compute)
    with pytest.raises(ValueError, match="model 'org/some-model' is not in the local Hugging Face cache"):
        FlowGRPOTrainer(**base, args=config, model="org/some-model")


@pytest.mark.parametrize("lora, match", [
    (dict(lora_dropout=0.1), r"peft_config.lora_dropout=0.1: must be 0"),
    (dict(use_dora=True), r"use_dora=True not supported"),
    (dict(target_modules="all-linear"), r"target_modules='all-linear': give a list"),
])
def test_bad_peft_configs_are_refused_before_any_compute(tmp_path, fresh_pipe, lora, match):
    from peft import LoraConfig

    with pytest.raises(ValueError, match=match):
        FlowGRPOTrainer(model=fresh_pipe(), reward_funcs=[brightness], args=tiny_config(tmp_path),
                        train_dataset=PROMPTS, peft_config=LoraConfig(**lora))


def test_peft_config_and_a_config_field_that_disagree_are_refused(tmp_path):
    from peft import LoraConfig

    config = tiny_config(tmp_path, lora_r=4)  # not the default (32)
    with pytest.raises(ValueError, match=r"peft_config.r=8 and the config's lora_r=4 differ"):
        trl_compat.apply_peft_config(config, LoraConfig(r=8))
    with pytest.raises(ValueError, match="finetune='lora'"):
        trl_compat.apply_peft_config(tiny_config(tmp_path, finetune="full"), LoraConfig(r=4))


# ----------------------------------------------------------------------------------------- model defaults
def test_model_settings_fill_the_fields_left_at_their_defaults(tmp_path, fresh_pipe, capsys):
    pipe = fresh_pipe()
    pipe.trl_flow_defaults = {"max_sequence_length": 7, "guidance_scale": 2.0}
    config = FlowGRPOConfig(output_dir=str(tmp_path / "o"), height=HEIGHT, width=WIDTH)
    resolved = trl_compat.apply_model_defaults(config, pipe)
    assert (resolved.max_sequence_length, resolved.guidance_scale) == (7, 2.0)
    assert "max_sequence_length=7, guidance_scale=2.0" in capsys.readouterr().out
    set_by_user = FlowGRPOConfig(output_dir=str(tmp_path / "o"), max_sequence_length=MAX_SEQ, guidance_scale=2.0)
    with pytest.warns(UserWarning, match=r"max_sequence_length=16 \(the model's: 7\)"):
        kept = trl_compat.apply_model_defaults(set_by_user, pipe)
    assert kept.max_sequence_length == MAX_SEQ
    pipe.trl_flow_defaults = {"max_seq_len": 1}
    with pytest.raises(ValueError, match=r"unknown settings \['max_seq_len'\]"):
        trl_compat.apply_model_defaults(config, pipe)


def test_shapes_model_carries_its_settings_from_its_folder(tmp_path, capsys):
    from trl_flow.tasks.shapes.model import BASE_MODEL_DIR, DEFAULT_GUIDANCE_SCALE, MAX_SEQUENCE_LENGTH, \
        load_base_pipeline

    with open(f"{BASE_MODEL_DIR}/{trl_compat.MODEL_DEFAULTS_FILE}") as f:
        declared = json.load(f)
    assert declared["max_sequence_length"] == MAX_SEQUENCE_LENGTH
    assert declared["guidance_scale"] == DEFAULT_GUIDANCE_SCALE
    pipe = load_base_pipeline()
    # the done-when case: only output_dir, size and steps set; resolved before the trainer builds anything
    config = FlowGRPOConfig(output_dir=str(tmp_path / "o"), height=32, width=32, max_steps=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resolved, _, _ = trl_compat.resolve_init_args(FlowGRPOTrainer.__new__(FlowGRPOTrainer), config, pipe,
                                                      [brightness])
    assert resolved.max_sequence_length == 1 and resolved.guidance_scale == 3.0
    assert "max_sequence_length=1" in capsys.readouterr().out
    trainer = FlowGRPOTrainer(config, pipe, [brightness], train_dataset=PROMPTS)
    assert trainer.config.max_sequence_length == 1
