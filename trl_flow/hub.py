"""Pushing a trained model to the Hugging Face Hub: a complete model card and only the files a user needs.

:func:`push_to_hub` first makes sure the model is saved in ``output_dir`` (``save_model``: the LoRA, or the whole
pipeline for full fine-tuning; ``train()`` has already saved it), so a Hub failure never costs the weights. It then
samples a before/after grid, writes ``README.md`` (``huggingface_hub.ModelCard`` from
``trl_flow/templates/model_card.md``, tags and library through diffusers' ``populate_model_card``) and uploads
exactly those files with ``HfApi.upload_folder(allow_patterns=...)``: never checkpoints, tracker folders, logs or
sample folders. The card holds the base model's Hub id (never a local path), the license, the method's paper
citation, every config field, the rewards, the final metrics and the library versions. A failed upload raises
``RuntimeError`` saying where the model is and the ``hf upload`` command (and the Python call) that pushes it later.

:func:`check_hub_access` fails fast, once, when the Hub cannot be used (``HF_HUB_OFFLINE``, no token, no network):
the trainer calls it at construction when ``push_to_hub=True``, so a run does not train for hours and then fail.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import warnings
from importlib import metadata

from .engine.distributed import agree

GRID_PATH = "images/before_after.png"
BUFFER_DIR = "replay_buffer"
TEMPLATE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "templates", "model_card.md")
NUM_CARD_PROMPTS = 4
CARD_SEED = 0
# Fields left out of the card's configuration: local paths and switches that say nothing about the model.
_PRIVATE_FIELDS = ("output_dir", "resume_from_checkpoint", "hub_private_repo", "disable_tqdm")
_VERSIONS = ("trl_flow", "torch", "diffusers", "transformers", "peft", "accelerate", "trl", "datasets",
             "huggingface_hub")

# BibTeX per paper, keyed by arXiv id (a trainer's `paper` attribute names it; a `citation` attribute overrides).
CITATIONS = {
    "2505.05470": """@article{liu2025flowgrpo,
  title   = {Flow-GRPO: Training Flow Matching Models via Online RL},
  author  = {Liu, Jie and Liu, Gongye and Liang, Jiajun and Li, Yangguang and Liu, Jiaheng and Wang, Xintao and
             Wan, Pengfei and Zhang, Di and Ouyang, Wanli},
  journal = {arXiv preprint arXiv:2505.05470},
  year    = {2025}
}""",
    "2604.04142": """@article{zhang2026opgrpo,
  title   = {OP-GRPO: Efficient Off-Policy GRPO for Flow-Matching Models},
  author  = {Zhang, Liyu and Li, Kehan and Han, Tingrui and Zhou, Tao and Sheng, Yuxuan and He, Shibo and Li, Chao},
  journal = {arXiv preprint arXiv:2604.04142},
  year    = {2026}
}""",
    "2603.28718": """@inproceedings{savani2026stepwise,
  title     = {Stepwise Credit Assignment for GRPO on Flow-Matching Models},
  author    = {Savani, Yash and Kveton, Branislav and Liu, Yuchen and Wang, Yilin and Shi, Jing and
               Mukherjee, Subhojyoti and Vlassis, Nikos and Singh, Krishna Kumar},
  booktitle = {Proceedings of the IEEE/CVF Conference on Computer Vision and Pattern Recognition (CVPR)},
  year      = {2026},
  note      = {arXiv:2603.28718}
}""",
    "2606.11025": """@article{ping2026flowdppo,
  title   = {Flow-DPPO: Divergence Proximal Policy Optimization for Flow Matching Models},
  author  = {Ping, Bowen and Zhou, Xiangxin and Qi, Penghui and Luo, Minnan and Bo, Liefeng and Pang, Tianyu},
  journal = {arXiv preprint arXiv:2606.11025},
  year    = {2026}
}""",
}
FLOW_GRPO_ARXIV = "2505.05470"


# ------------------------------------------------------------------------------------------------ timeouts
#: Seconds one Hub request (whoami, create_repo, model_info) may take before it counts as hung, and how many more
#: tries a hung request gets; ``TRL_FLOW_HUB_TIMEOUT`` / ``TRL_FLOW_HUB_RETRIES`` override them. An upload gets
#: ``max(UPLOAD_MIN_TIMEOUT_S, its bytes / UPLOAD_MIN_RATE)`` and no retry (a hung upload may still be running).
HUB_TIMEOUT_S = 30.0
HUB_RETRIES = 2
UPLOAD_MIN_TIMEOUT_S = 600.0
UPLOAD_MIN_RATE = 2**20  # bytes per second


class HubTimeoutError(TimeoutError):
    """A Hub request that did not answer within its time limit, on every try."""


def hub_timeout() -> float:
    return float(os.environ.get("TRL_FLOW_HUB_TIMEOUT") or HUB_TIMEOUT_S)


def hub_retries() -> int:
    return int(os.environ.get("TRL_FLOW_HUB_RETRIES") or HUB_RETRIES)


def _timed_out(error: BaseException) -> bool:
    """The HTTP library's own timeout (httpx / requests / socket), which counts as a hang too."""
    return isinstance(error, TimeoutError) or "Timeout" in type(error).__name__


def hub_call(what: str, fn, timeout: float | None = None, retries: int | None = None):
    """``fn()`` (one Hub request) with a time limit: it runs in a daemon thread, so a Hub that accepts the
    connection and never answers cannot hang the run; a hung try (or the library's own timeout) is repeated up to
    ``retries`` times, then :class:`HubTimeoutError` names ``what``. Other errors are raised at once."""
    import threading
    import time

    from huggingface_hub import constants

    timeout = hub_timeout() if timeout is None else timeout
    retries = hub_retries() if retries is None else retries
    for attempt in range(1 + retries):
        box: dict = {}

        def run():
            try:
                box["value"] = fn()
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                box["error"] = e

        thread = threading.Thread(target=run, name=f"trl_flow-hub-{what}", daemon=True)
        thread.start()
        thread.join(timeout)
        if "error" in box and not _timed_out(box["error"]):
            raise box["error"]
        if not thread.is_alive() and "error" not in box:
            return box.get("value")
        if attempt < retries:
            time.sleep(min(2.0**attempt, 10.0))
    tries = f"{1 + retries} tries" if retries else "1 try"
    raise HubTimeoutError(f"the Hub at {constants.ENDPOINT} did not answer {what} within {timeout:g} s ({tries}; "
                          "TRL_FLOW_HUB_TIMEOUT / TRL_FLOW_HUB_RETRIES set the limits)")


# ------------------------------------------------------------------------------------------------ access
def check_hub_access(accelerator=None, hint: bool = True) -> None:
    """Raise ``RuntimeError`` now if pushing cannot work: ``HF_HUB_OFFLINE`` is set, there is no token, or the Hub
    does not answer / rejects the token. One ``whoami`` request, no retries. With several processes the main process
    checks and every process raises (none is left waiting in a collective). ``hint``: end the message with the
    ``push_to_hub=False`` advice (before training; not after it)."""
    error = None
    if accelerator is None or accelerator.is_main_process:
        error = _hub_access_error(hint)
    if accelerator is not None:
        error = agree(accelerator, error)
    if error:
        raise RuntimeError(error)


def _one_line(error: BaseException, limit: int = 300) -> str:
    return " ".join(str(error).split())[:limit]


def _hub_access_error(hint: bool = True) -> str | None:
    from huggingface_hub import HfApi, constants, get_token

    hint = "or set push_to_hub=False (save_model() writes the model locally)" if hint else "then push again"
    if constants.HF_HUB_OFFLINE:
        return f"push_to_hub: HF_HUB_OFFLINE is set, so nothing can be uploaded; unset HF_HUB_OFFLINE {hint}"
    if get_token() is None:
        return f"push_to_hub: no Hugging Face token; run `hf auth login` or set HF_TOKEN, {hint}"
    try:
        hub_call("whoami (the token check)", HfApi().whoami)
    except HubTimeoutError as e:
        return f"push_to_hub: {e}; check the network and HF_ENDPOINT, {hint}"
    except Exception as e:  # no network, DNS failure, proxy, rejected token: all end the same way
        return (f"push_to_hub: the Hub at {constants.ENDPOINT} cannot be used ({type(e).__name__}: {_one_line(e)}); "
                f"check the network and the token, {hint}")
    return None


# ------------------------------------------------------------------------------------------------ card data
def is_hub_id(name: str | None) -> bool:
    """Whether ``name`` is a Hub model id (``org/name``) and not a path on this machine."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not name or os.path.exists(name) or name.count("/") != 1 or name.startswith((".", "~")):
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def base_model_id(pipe, config) -> str | None:
    """The base model's Hub id: ``config.hub_base_model``, else the pipeline's own name if it is a Hub id, else
    ``None`` with a warning (a local folder or an in-memory pipeline)."""
    if config.hub_base_model:
        return config.hub_base_model
    name = getattr(pipe, "name_or_path", None) or dict(getattr(pipe, "config", {}) or {}).get("_name_or_path")
    if is_hub_id(name):
        return name
    where = "a local folder" if name else "components built in memory"
    warnings.warn(f"model card: no base_model, the pipeline was loaded from {where}; set hub_base_model to the "
                  "Hub id of the model it was trained from", stacklevel=3)
    return None


def license_info(config, base_model: str | None) -> dict:
    """``license`` (and ``license_name`` / ``license_link`` for `other` licenses): ``config.hub_license``, else
    the base model's, read from its Hub card. Empty, with a warning, when neither is known."""
    from huggingface_hub import HfApi, constants

    if config.hub_license:
        return {"license": config.hub_license}
    if base_model:
        try:
            data = hub_call(f"model_info({base_model})", lambda: HfApi().model_info(base_model)).card_data
        except Exception as e:
            warnings.warn(f"model card: could not read the license of {base_model} ({type(e).__name__}: {e}); "
                          "set hub_license", stacklevel=3)
            return {}
        out = {k: data.get(k) for k in ("license", "license_name", "license_link") if data is not None and data.get(k)}
        link = out.get("license_link")
        if link and not link.startswith(("http://", "https://")):  # relative to the base model's repository
            out["license_link"] = f"{constants.ENDPOINT}/{base_model}/blob/main/{link}"
        if out:
            return out
    warnings.warn("model card: no license; set hub_license (e.g. the base model's license)", stacklevel=3)
    return {}


def _arxiv_id(trainer) -> str | None:
    m = re.search(r"(\d{4}\.\d{4,5})", getattr(trainer, "paper", "") or "")
    return m.group(1) if m else None


def citations(trainer) -> str:
    """BibTeX of the trainer's paper, and of Flow-GRPO when the method builds on it."""
    own = getattr(trainer, "citation", None) or CITATIONS.get(_arxiv_id(trainer) or "")
    entries = [own] if own else []
    if _arxiv_id(trainer) != FLOW_GRPO_ARXIV:
        entries.append(CITATIONS[FLOW_GRPO_ARXIV])
    return "\n\n".join(entries)


def final_metrics(log_history: list[dict]) -> list[tuple[str, str]]:
    """(name, value) of the last evaluation's metrics and of the last iteration's reward metrics."""
    last_eval = next((h for h in reversed(log_history) if "eval/reward" in h), None)
    last_train = next((h for h in reversed(log_history) if "reward" in h), None)
    rows = []
    if last_eval:
        rows += [(k, v) for k, v in last_eval.items() if k.startswith("eval/")]
    if last_train:
        keep = ("reward", "reward_std", "kl", "clip_frac")
        rows += [(k, v) for k, v in last_train.items() if k in keep or k.startswith("rewards/")]
    step = (last_eval or last_train or {}).get("step")
    return [(f"{k} (step {int(step)})" if step is not None else k, f"{v:.4g}") for k, v in rows]


def library_versions() -> list[tuple[str, str]]:
    out = []
    for name in _VERSIONS:
        try:
            out.append((name, metadata.version(name)))
        except metadata.PackageNotFoundError:
            if name == "trl_flow":
                import trl_flow

                out.append((name, trl_flow.__version__))
    return out


def card_prompts(trainer, n: int = NUM_CARD_PROMPTS) -> list[str]:
    """The prompts of the card's sample grid: the first evaluation prompts, else the first training prompts."""
    ds = trainer.eval_dataset if trainer.eval_dataset is not None else trainer.train_dataset
    return list(ds["prompt"][: min(n, len(ds))])


def card_columns(trainer, n: int) -> dict:
    """The other dataset columns of :func:`card_prompts`' rows (an editing run's source images)."""
    ds = trainer.eval_dataset if trainer.eval_dataset is not None else trainer.train_dataset
    rows = ds[: min(n, len(ds))]
    rows.pop("prompt")
    return rows


def before_after(trainer, prompts: list[str], seed: int = CARD_SEED, columns: dict | None = None):
    """ODE samples of ``prompts`` from the base model (top row; LoRA disabled, or the frozen reference copy) and
    from the trained one (bottom row; EMA weights if EMA is on), same noise. Returns (grid or None, has_before).
    Runs on every process (sharded models need all of them); cheap: ``2 x len(prompts)`` images. ``columns``: the
    prompts' dataset columns (default: :func:`card_columns`; an editing model reads its source images there)."""
    from .video import grid

    cfg = trainer.config
    if columns is None:
        columns = card_columns(trainer, len(prompts))
    with trainer.ema_weights():
        after, _ = trainer.generate(prompts, seed=seed, columns=columns)
    before = None
    if cfg.finetune == "lora" or trainer.ref_model is not None:
        with trainer.reference_policy() as ref:  # LoRA: the trained model with its adapters disabled
            before, _ = trainer.generate(prompts, seed=seed, columns=columns,
                                         model=None if cfg.finetune == "lora" else ref)
    import torch

    images = after if before is None else torch.cat([before, after])
    return grid(images, cols=len(prompts)), before is not None


def _call(trainer, prompt: str) -> str:
    """The card's sampling line: an editing model takes the source image too."""
    if getattr(trainer.adapter, "conditioning", "text") == "text_and_image":
        return ('from diffusers.utils import load_image\n\n'
                f'image = pipe(image=load_image("source.png"), prompt={prompt!r}).images[0]')
    return f"image = pipe({prompt!r}).images[0]"


def build_model_card(trainer, repo_id: str, base_model: str | None, license: dict, prompts: list[str],
                     has_before: bool):
    """The ``huggingface_hub.ModelCard`` of a trained model (see the module docstring for what it holds)."""
    import yaml
    from diffusers.utils.hub_utils import populate_model_card
    from huggingface_hub import ModelCard, ModelCardData

    cfg = trainer.config
    method = (getattr(trainer, "paper", "") or trainer._method_name).split(",")[0].strip()
    method_tag = trainer._method_name.replace("_", "-")
    pipeline_tag = getattr(trainer.adapter, "pipeline_tag", None) or "text-to-image"
    lora = cfg.finetune == "lora"
    widget = [{"text": prompts[0], "output": {"url": GRID_PATH}}]
    data = ModelCardData(base_model=base_model, pipeline_tag=pipeline_tag, widget=widget,
                         base_model_relation=("adapter" if lora else "finetune") if base_model else None, **license)
    fields = {k: v for k, v in cfg.resolved_dict().items() if k not in _PRIVATE_FIELDS}
    rewards = ", ".join(f"`{n}` (weight {w:g})" for n, w in zip(trainer.reward_names, trainer.reward_weights))
    if lora:
        load = trainer.adapter.lora_load_code(repo_id)
        usage = ("import torch\nfrom diffusers import DiffusionPipeline\n\n"
                 + (f'pipe = DiffusionPipeline.from_pretrained("{base_model}", torch_dtype=torch.bfloat16)\n'
                    if base_model else "# pipe: the diffusers pipeline this LoRA was trained from\n")
                 + f'{load}\n{_call(trainer, prompts[0])}')
    else:
        usage = ("import torch\nfrom diffusers import DiffusionPipeline\n\n"
                 f'pipe = DiffusionPipeline.from_pretrained("{repo_id}", torch_dtype=torch.bfloat16)\n'
                 f'{_call(trainer, prompts[0])}')
    base_text = f"[{base_model}](https://huggingface.co/{base_model})" if base_model else "its base pipeline"
    kind = "A LoRA for" if lora else "A fine-tune of"
    grid_caption = (("Top row: the base model; bottom row: after training. " if has_before
                     else "After training (the base model's samples are not available for full fine-tuning "
                          "without a reference copy, `beta` = 0). ")
                    + f"Deterministic (ODE) samples, {cfg.eval_num_inference_steps} steps, same noise, prompts: "
                    + "; ".join(f"*{p}*" for p in prompts) + ".")
    card = ModelCard.from_template(
        data,
        template_path=TEMPLATE,
        model_name=repo_id.split("/")[-1],
        summary=(f"{kind} {base_text}, trained with reinforcement learning by trl_flow's "
                 f"`{type(trainer).__name__}` ({method})."),
        grid_caption=grid_caption,
        usage=usage,
        method=method,
        arxiv=_arxiv_id(trainer) or "",
        trainer_class=type(trainer).__name__,
        rewards=rewards,
        iterations=trainer.state.global_step,
        images_per_iteration=cfg.train_batch_size,
        prompts_per_step=cfg.prompts_per_step,
        num_generations=cfg.num_generations,
        num_prompts=len(trainer.train_dataset),
        finetune=(f"LoRA r={cfg.lora_r}, alpha={cfg.lora_alpha}" if lora else "all transformer weights"),
        metrics=final_metrics(trainer.state.log_history),
        config_class=type(cfg).__name__,
        config_yaml=yaml.safe_dump(fields, sort_keys=False),
        versions=library_versions(),
        citations=citations(trainer),
    )
    tags = ["trl", "trl-flow", method_tag, "diffusers"] + (["lora"] if lora else []) + [pipeline_tag]
    return populate_model_card(card, tags=tags)


# ------------------------------------------------------------------------------------------------- upload
def upload_patterns(trainer, include_replay_buffer: bool) -> list[str]:
    """The files of ``output_dir`` that are uploaded: the model ``save_model`` wrote, the card, the grid, and the
    replay buffer if asked for."""
    if trainer.config.finetune == "lora":
        patterns = list(trainer.adapter.lora_weight_names())
    else:  # save_pretrained: model_index.json and one folder per component
        patterns = ["model_index.json"] + [f"{name}/*" for name, c in trainer.pipe.components.items() if c is not None]
    patterns += ["README.md", GRID_PATH]
    if include_replay_buffer:
        patterns.append(f"{BUFFER_DIR}/*")
    return patterns


def push_to_hub(trainer, commit_message: str = "End of training", private: bool | None = None,
                include_replay_buffer: bool | None = None) -> str:
    """Save (unless already saved), card and upload ``trainer``'s model to ``config.hub_model_id`` (default: the
    output folder's name).

    Call it on every process (the model is saved and sampled collectively); the main process uploads. Returns the
    repository id. Any failure after the save raises ``RuntimeError`` on every process with :func:`push_later`'s
    instructions: the model, card and grid stay in ``output_dir``."""
    cfg, acc = trainer.config, trainer.accelerator
    include = cfg.hub_include_replay_buffer if include_replay_buffer is None else include_replay_buffer
    if include and getattr(trainer, "replay_buffer", None) is None:
        raise ValueError(f"hub_include_replay_buffer: {type(trainer).__name__} keeps no replay buffer (OP-GRPO does)")
    trainer.save_model(cfg.output_dir)  # first, always: what follows needs the Hub, the weights must not
    repo_id = cfg.hub_model_id or os.path.basename(os.path.abspath(cfg.output_dir))
    private = private if private is not None else cfg.hub_private_repo
    try:
        check_hub_access(acc, hint=False)
        error = None
    except RuntimeError as e:
        error = str(e)
    if error is None:
        prompts = card_prompts(trainer)
        image, has_before = before_after(trainer, prompts)  # every process (sharded models)
        if acc.is_main_process:
            try:
                repo_id = _write_and_upload(trainer, repo_id, private, commit_message, include, prompts, image,
                                            has_before)
            except Exception as e:  # network, HTTP, auth: the model is on disk, say how to push it later
                error = f"push_to_hub: the upload to {repo_id} failed ({type(e).__name__}: {_one_line(e)})"
        error = agree(acc, error)
    if error:
        raise RuntimeError(f"{error}. {push_later(trainer, repo_id, include, private)}")
    acc.wait_for_everyone()
    return repo_id


def _write_and_upload(trainer, repo_id, private, commit_message, include, prompts, image, has_before) -> str:
    """Main process: grid, buffer and card into output_dir (before any Hub write, so a later push has them), then
    create the repository and upload. Returns the repository id the Hub gives."""
    from huggingface_hub import HfApi

    cfg = trainer.config
    api = HfApi()
    os.makedirs(os.path.join(cfg.output_dir, os.path.dirname(GRID_PATH)), exist_ok=True)
    image.save(os.path.join(cfg.output_dir, GRID_PATH))
    if include:
        buffer_dir = os.path.join(cfg.output_dir, BUFFER_DIR)
        shutil.rmtree(buffer_dir, ignore_errors=True)
        trainer.replay_buffer.save_to_disk(buffer_dir)
    base = base_model_id(trainer.pipe, cfg)
    license = license_info(cfg, base)
    card_path = os.path.join(cfg.output_dir, "README.md")
    build_model_card(trainer, repo_id, base, license, prompts, has_before).save(card_path)
    full_id = hub_call(f"create_repo({repo_id})",
                       lambda: api.create_repo(repo_id, exist_ok=True, private=private)).repo_id
    if full_id != repo_id:  # the Hub added the namespace: the card's usage names the full id
        build_model_card(trainer, full_id, base, license, prompts, has_before).save(card_path)
    patterns = upload_patterns(trainer, include)
    hub_call(f"upload_folder({full_id})",
             lambda: api.upload_folder(repo_id=full_id, folder_path=cfg.output_dir, commit_message=commit_message,
                                       allow_patterns=patterns),
             timeout=upload_timeout(cfg.output_dir, patterns), retries=0)
    return full_id


def _matches(folder: str, pattern: str) -> list[str]:
    """The files of ``folder`` an upload pattern selects."""
    import glob

    return [p for p in glob.glob(os.path.join(folder, pattern)) if os.path.isfile(p)]


def upload_timeout(folder: str, patterns: list[str]) -> float:
    """Seconds an upload of these files may take: at least UPLOAD_MIN_TIMEOUT_S, else at UPLOAD_MIN_RATE."""
    size = sum(os.path.getsize(p) for pat in patterns for p in _matches(folder, pat))
    if os.environ.get("TRL_FLOW_HUB_TIMEOUT"):
        return max(hub_timeout(), size / UPLOAD_MIN_RATE)
    return max(UPLOAD_MIN_TIMEOUT_S, size / UPLOAD_MIN_RATE)


def push_later(trainer, repo_id: str, include_replay_buffer: bool = False, private: bool | None = None) -> str:
    """What a failed push says: where the model is, and the command (and Python call) that uploads exactly the
    files :func:`push_to_hub` would have, of those that exist (the card and the grid are written only once the Hub
    answered)."""
    cfg = trainer.config
    folder = os.path.abspath(cfg.output_dir)
    patterns = [p for p in upload_patterns(trainer, include_replay_buffer) if _matches(folder, p)]
    model = (" + ".join(trainer.adapter.lora_weight_names()) if cfg.finetune == "lora"
             else "model_index.json and the pipeline's component folders")
    command = " ".join(["hf", "upload", shlex.quote(repo_id), shlex.quote(folder), "."]
                       + [f"--include {shlex.quote(p)}" for p in patterns] + (["--private"] if private else []))
    written = [name for name in ("README.md", GRID_PATH) if os.path.isfile(os.path.join(folder, name))]
    extra = ("; the model card " + " and ".join(written)) if written else "; no model card was written"
    return (f"Nothing is lost: the trained model is saved in {folder} ({model}{extra}). Push it later with: "
            f"{command} -- or in Python: "
            f"HfApi().upload_folder(repo_id={repo_id!r}, folder_path={folder!r}, allow_patterns={patterns!r})")
