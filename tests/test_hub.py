"""push_to_hub: exactly which files reach the Hub, what the model card says, that the upload loads with
load_lora_weights, and that a push that cannot work fails at construction. Uploads are intercepted at the
huggingface_hub API boundary (HfApi methods); nothing touches the network."""

from __future__ import annotations

import ast
import os
import shutil
import types
from pathlib import Path

import pytest
import torch
from conftest import PROMPTS, brightness, tiny_config

BASE = "stabilityai/stable-diffusion-3.5-medium"


class FakeHub:
    """Stands in for the Hub behind HfApi: records calls, stores uploaded files under ``remote``."""

    def __init__(self, remote: Path):
        self.remote = remote
        self.calls = []

    def whoami(self, *args, **kwargs):
        self.calls.append("whoami")
        return {"name": "me"}

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", repo_id, kwargs))
        return types.SimpleNamespace(repo_id=repo_id if "/" in repo_id else f"me/{repo_id}")

    def model_info(self, repo_id, **kwargs):
        from huggingface_hub import ModelCardData

        self.calls.append(("model_info", repo_id))
        return types.SimpleNamespace(card_data=ModelCardData(
            license="other", license_name="stabilityai-ai-community", license_link="LICENSE.md"))

    def upload_folder(self, *, repo_id, folder_path, allow_patterns=None, ignore_patterns=None, **kwargs):
        """What upload_folder sends: the folder's files filtered by huggingface_hub's own pattern filter."""
        from huggingface_hub.utils import filter_repo_objects

        self.calls.append(("upload_folder", repo_id))
        files = [p.relative_to(folder_path).as_posix() for p in Path(folder_path).rglob("*") if p.is_file()]
        for rel in filter_repo_objects(files, allow_patterns=allow_patterns, ignore_patterns=ignore_patterns):
            (self.remote / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(Path(folder_path) / rel, self.remote / rel)

    def uploaded(self) -> set[str]:
        return {p.relative_to(self.remote).as_posix() for p in self.remote.rglob("*") if p.is_file()}


@pytest.fixture
def online_hub(tmp_path, monkeypatch):
    """The Hub as seen through HfApi, online, logged in."""
    import huggingface_hub.constants as constants
    from huggingface_hub import HfApi

    hub = FakeHub(tmp_path / "remote")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    for name in ("whoami", "create_repo", "model_info"):
        monkeypatch.setattr(HfApi, name, lambda self, *a, _n=name, **k: getattr(hub, _n)(*a, **k))
    monkeypatch.setattr(HfApi, "upload_folder", lambda self, **k: hub.upload_folder(**k))
    return hub


def _lora_state(trainer):
    from peft.utils import get_peft_model_state_dict

    return {k: v.detach().clone() for k,
            v in get_peft_model_state_dict(trainer.accelerator.unwrap_model(trainer.model)).items()}


def test_push_uploads_only_lora_card_grid_and_buffer_and_the_card_is_complete(online_hub, tmp_path, fresh_pipe):
    from huggingface_hub import ModelCard

    from trl_flow import OPGRPOConfig, OPGRPOTrainer
    from trl_flow.replay_buffer import ReplayBuffer

    out = tmp_path / "out"
    cfg = tiny_config(tmp_path, OPGRPOConfig, output_dir=str(out), max_steps=1, prompts_per_step=4, num_generations=2,
                      push_to_hub=True, hub_model_id="tiny-op-grpo", hub_base_model=BASE,
                      hub_include_replay_buffer=True, save_steps=1, report_to="tensorboard", run_name="tb",
                      eval_steps=1, log_images_steps=1)
    eval_prompts = ['a sign saying "hi"', "a red dog"]  # quotes must survive the card's YAML and code
    trainer = OPGRPOTrainer(cfg, fresh_pipe(), [brightness], train_dataset=list(PROMPTS), eval_dataset=eval_prompts)
    assert online_hub.calls == ["whoami"]  # checked once, at construction
    trainer.train()

    # Locally there is more (checkpoint, tensorboard run, logs, sample grids); only the model's files went up.
    assert {"checkpoint-1", "tb", "log_history.jsonl", "samples"} <= set(os.listdir(out))
    assert online_hub.uploaded() == {
        "README.md", "pytorch_lora_weights.safetensors", "images/before_after.png",
        "replay_buffer/data-00000-of-00001.arrow", "replay_buffer/dataset_info.json", "replay_buffer/state.json"}
    assert ("create_repo", "tiny-op-grpo", {"exist_ok": True, "private": None}) in online_hub.calls
    buffer = ReplayBuffer.load_from_disk(online_hub.remote / "replay_buffer")
    assert len(buffer) == len(trainer.replay_buffer) > 0

    card = ModelCard.load(online_hub.remote / "README.md")
    data = card.data.to_dict()
    assert data["base_model"] == BASE and data["library_name"] == "diffusers"
    assert data["license"] == "other" and data["license_name"] == "stabilityai-ai-community"
    assert data["license_link"] == f"https://huggingface.co/{BASE}/blob/main/LICENSE.md"
    assert data["tags"] == ["trl", "trl-flow", "op-grpo", "diffusers", "lora", "text-to-image"]
    assert data["pipeline_tag"] == "text-to-image" and data["base_model_relation"] == "adapter"
    assert data["widget"] == [{"text": eval_prompts[0], "output": {"url": "images/before_after.png"}}]
    text = card.text
    assert "@article{zhang2026opgrpo" in text and "@article{liu2025flowgrpo" in text  # OP-GRPO builds on Flow-GRPO
    assert "`brightness` (weight 1)" in text
    last_eval = [h for h in trainer.state.log_history if "eval/reward" in h][-1]
    assert f"| `eval/brightness (step 1)` | {last_eval['eval/brightness']:.4g} |" in text
    assert "num_generations: 2\n" in text and "off_policy_fraction: 0.25\n" in text  # the config, every field
    import diffusers

    assert f"- diffusers: {diffusers.__version__}" in text
    usage = text.split("```python\n")[1].split("```")[0]
    ast.parse(usage)
    assert 'pipe.load_lora_weights("me/tiny-op-grpo")' in usage and repr(eval_prompts[0]) in usage
    assert "TODO" not in text and "More Information Needed" not in text
    assert str(tmp_path) not in str(card)  # no path of this machine anywhere in the card

    # The before/after grid: 2 rows (base, trained) x 2 eval prompts of 32x32 images.
    from PIL import Image

    assert Image.open(online_hub.remote / "images/before_after.png").size == (2 * 32, 2 * 32)

    # The uploaded folder is what `pipe.load_lora_weights(repo_id)` downloads: it loads, with the trained weights.
    from peft.utils import get_peft_model_state_dict

    pipe = fresh_pipe()
    pipe.load_lora_weights(str(online_hub.remote))
    (adapter,) = pipe.transformer.peft_config
    loaded = get_peft_model_state_dict(pipe.transformer, adapter_name=adapter)
    trained = _lora_state(trainer)
    assert sorted(loaded) == sorted(trained) and len(trained) > 0
    assert all(torch.equal(loaded[k], trained[k]) for k in trained)
    assert pipe.transformer.peft_config[adapter].lora_alpha == 8  # alpha != r round-trips through the metadata


def test_push_with_hub_offline_fails_at_construction_before_any_compute(fresh_pipe, tmp_path):
    from trl_flow import FlowGRPOTrainer

    calls = []

    def counting(images, prompts, **kw):
        calls.append(len(prompts))
        return brightness(images, prompts)

    pipe = fresh_pipe()
    with pytest.raises(RuntimeError, match="HF_HUB_OFFLINE is set.*push_to_hub=False"):
        FlowGRPOTrainer(tiny_config(tmp_path, push_to_hub=True), pipe, [counting], train_dataset=PROMPTS)
    assert calls == []  # no reward call, no LoRA added, nothing sampled
    assert not getattr(pipe.transformer, "peft_config", None)


def test_unreachable_hub_fails_fast_with_one_request(monkeypatch, fresh_pipe, tmp_path):
    import huggingface_hub.constants as constants
    from huggingface_hub import HfApi

    from trl_flow import FlowGRPOTrainer

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    real_whoami, calls = HfApi.whoami, []

    def whoami(self, *a, **k):
        calls.append(self.endpoint)
        return real_whoami(self, *a, **k)

    monkeypatch.setattr(HfApi, "whoami", whoami)
    with pytest.raises(RuntimeError, match=r"the Hub at http://127\.0\.0\.1:9 cannot be used"):
        FlowGRPOTrainer(tiny_config(tmp_path, push_to_hub=True), fresh_pipe(), [brightness], train_dataset=PROMPTS)
    assert calls == ["http://127.0.0.1:9"]  # one request, no retries


def test_no_token_fails_at_construction(monkeypatch, fresh_pipe, tmp_path):
    import huggingface_hub.constants as constants

    from trl_flow import FlowGRPOTrainer

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr("huggingface_hub.get_token", lambda: None)
    with pytest.raises(RuntimeError, match="no Hugging Face token"):
        FlowGRPOTrainer(tiny_config(tmp_path, push_to_hub=True), fresh_pipe(), [brightness], train_dataset=PROMPTS)


def test_base_model_is_a_hub_id_never_a_local_path(tmp_path, base_pipe):
    from trl_flow.hub import base_model_id

    cfg = tiny_config(tmp_path)
    local = tmp_path / "my-org" / "model"
    local.mkdir(parents=True)
    pipe = types.SimpleNamespace(name_or_path=BASE, config={})
    assert base_model_id(pipe, cfg) == BASE
    for name in (str(local), os.path.relpath(local), "./model", "a/b/c"):
        with pytest.warns(UserWarning, match="set hub_base_model"):
            assert base_model_id(types.SimpleNamespace(name_or_path=name, config={}), cfg) is None
    with pytest.warns(UserWarning, match="built in memory"):
        assert base_model_id(base_pipe, cfg) is None
    assert base_model_id(base_pipe, tiny_config(tmp_path, hub_base_model="org/base")) == "org/base"
    with pytest.raises(ValueError, match="hub_base_model"):
        tiny_config(tmp_path, hub_base_model="/abs/path/model")


def test_card_citations_and_pipeline_tag_follow_the_trainer(tmp_path):
    from trl_flow import FlowGRPOTrainer
    from trl_flow.hub import CITATIONS, citations

    flow = types.SimpleNamespace(paper=FlowGRPOTrainer.paper)
    assert citations(flow) == CITATIONS["2505.05470"]
    for arxiv in ("2604.04142", "2603.28718", "2606.11025"):
        text = citations(types.SimpleNamespace(paper=f"Method, arXiv {arxiv}"))
        assert text.startswith(CITATIONS[arxiv]) and CITATIONS["2505.05470"] in text
    assert citations(
        types.SimpleNamespace(paper="X, arXiv 2604.04142", citation="@misc{own}")).startswith("@misc{own}")


def test_replay_buffer_upload_needs_a_trainer_with_a_buffer(online_hub, make_trainer):
    trainer = make_trainer(max_steps=1)
    with pytest.raises(ValueError, match="hub_include_replay_buffer: FlowGRPOTrainer keeps no replay buffer"):
        trainer.push_to_hub(include_replay_buffer=True)
    assert online_hub.calls == [] and not online_hub.remote.exists()  # refused before anything was sent


def test_full_finetune_uploads_the_pipeline_folders(online_hub, tmp_path, fresh_pipe):
    from trl_flow import FlowGRPOTrainer
    from trl_flow.models import load_pipeline

    cfg = tiny_config(tmp_path, finetune="full", beta=0.04, max_steps=1, hub_model_id="me/tiny-full",
                      hub_license="apache-2.0")
    trainer = FlowGRPOTrainer(cfg, fresh_pipe(), [brightness], train_dataset=PROMPTS)
    trainer.train()
    trainer.adapter.pipeline_tag = "text-to-video"  # what a video family's adapter declares
    with pytest.warns(UserWarning, match="no base_model"):
        trainer.push_to_hub()
    files = online_hub.uploaded()
    assert {"README.md", "model_index.json", "images/before_after.png"} <= files
    assert {f.split("/")[0] for f in files} == {"README.md", "model_index.json", "images", "transformer", "vae",
                                                "scheduler", "text_encoder", "text_encoder_2", "tokenizer",
                                                "tokenizer_2"}
    from huggingface_hub import ModelCard

    data = ModelCard.load(online_hub.remote / "README.md").data.to_dict()
    assert data["license"] == "apache-2.0" and "base_model" not in data and "lora" not in data["tags"]
    assert data["pipeline_tag"] == "text-to-video" and data["tags"][-1] == "text-to-video"
    reloaded = load_pipeline(str(online_hub.remote))
    trained = trainer.accelerator.unwrap_model(trainer.model).state_dict()
    assert all(torch.equal(v, trained[k]) for k, v in reloaded.transformer.state_dict().items())
