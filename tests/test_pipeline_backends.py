"""load_pipeline names a missing optional package of a component (FLUX.2-dev's PixtralProcessor tokenizer needs
torchvision) in one line, with the pip command that keeps the installed torch, before any weight is loaded."""

from __future__ import annotations

import importlib.util
import json

import pytest

from trl_flow.models import load_pipeline

FLUX2_DEV_INDEX = {  # black-forest-labs/FLUX.2-dev's model_index.json
    "_class_name": "Flux2Pipeline", "_diffusers_version": "0.36.0.dev0",
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"], "text_encoder": ["transformers",
                                                                                   "Mistral3ForConditionalGeneration"],
    "tokenizer": ["transformers", "PixtralProcessor"], "transformer": ["diffusers", "Flux2Transformer2DModel"],
    "vae": ["diffusers", "AutoencoderKLFlux2"],
}


def _folder(tmp_path):
    (tmp_path / "model_index.json").write_text(json.dumps(FLUX2_DEV_INDEX))
    return str(tmp_path)


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is not None, reason="torchvision is installed")
def test_flux2_dev_without_torchvision_fails_in_one_line_naming_the_install(tmp_path):
    with pytest.raises(ImportError) as e:
        load_pipeline(_folder(tmp_path))
    msg = str(e.value)
    assert "\n" not in msg and "component `tokenizer` (PixtralProcessor) needs torchvision" in msg
    assert 'pip install "torchvision==0.' in msg


def test_a_missing_backend_is_named_with_the_matching_torchvision(tmp_path, monkeypatch):
    """Whatever is installed here: a component class that transformers replaced by a placeholder (its package is
    missing) is refused before loading; torchvision's release follows torch's (2.13 -> 0.28), from the CPU index
    for a CPU torch."""
    import torch
    import transformers
    from transformers.utils.import_utils import DummyObject

    class PixtralProcessor(metaclass=DummyObject):
        _backends = ["torchvision"]

    monkeypatch.setattr(transformers, "PixtralProcessor", PixtralProcessor, raising=False)
    for version, expected in (("2.13.0+cpu", 'pip install "torchvision==0.28.*" --index-url '
                                             "https://download.pytorch.org/whl/cpu (the torchvision release of "
                                             "torch 2.13.0+cpu)"),
                              ("2.14.1+cu128", 'pip install "torchvision==0.29.*" (the torchvision release of torch '
                                               "2.14.1+cu128)")):
        monkeypatch.setattr(torch, "__version__", version)
        with pytest.raises(ImportError, match="^" + __import__("re").escape(
                f"{tmp_path}: component `tokenizer` (PixtralProcessor) needs torchvision, which is not installed: "
                f"{expected}") + "$"):
            load_pipeline(_folder(tmp_path))
