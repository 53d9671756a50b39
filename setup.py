from setuptools import find_packages, setup

setup(
    name="trl_flow",
    version="0.1.0.dev0",
    description="Reinforcement-learning post-training (Flow-GRPO and the methods built on it, DiffusionNFT) "
    "for flow-matching text-to-image and text-to-video diffusers pipelines.",
    long_description=open("README.md", encoding="utf-8").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["trl_flow", "trl_flow.*"]),
    include_package_data=True,
    package_data={
        "trl_flow.tasks.shapes": ["base_model/**/*", "base_model/*", "base_model_noisy/**/*", "base_model_noisy/*"],
        "trl_flow": ["accelerate_configs/*.yaml", "recipes/*.yaml", "recipes/*.md", "templates/*.md"],
    },
    entry_points={"console_scripts": ["trl-flow=trl_flow.cli:main"]},
    python_requires=">=3.10",
    # torch is deliberately NOT pinned here beyond a floor: install it first (see README), since a bare
    # `torch` requirement resolved by pip pulls a multi-GB CUDA build.
    install_requires=[
        "torch>=2.4",
        "diffusers>=0.35",
        "transformers>=4.51",
        "peft>=0.17",
        "accelerate>=1.4",
        "datasets>=3.0",
        "trl>=0.20",
        "safetensors",
        "huggingface_hub",
        "jinja2",
        "pyyaml",
        "numpy",
        "pillow",
        "tqdm",
    ],
    extras_require={
        "test": ["pytest>=8", "ftfy", "matplotlib", "scipy", "tensorboard", "wandb", "fastapi>=0.110", "uvicorn>=0.29",
                 "ruff"],
        # rewards (docs/rewards.md): pickscore, clip_score, aesthetic and ocr need nothing beyond transformers.
        # hpsv2 and image-reward pin incompatible timm versions: install one, or serve the other (`serve`).
        "serve": ["fastapi>=0.110", "uvicorn>=0.29"],
        "hpsv2": ["open_clip_torch>=2.20"],
        "image-reward": ["image-reward>=1.5"],
        "wandb": ["wandb"],
        "quant": ["bitsandbytes"],
        "bench": ["matplotlib", "scipy"],
        # WanImageToVideoPipeline (diffusers <= 0.42) cleans prompts with ftfy without checking it is installed
        "video": ["ftfy"],
        # No "flux2" extra: FLUX.2-dev's tokenizer (transformers' PixtralProcessor) needs torchvision, but an
        # unpinned torchvision requirement makes pip take the newest torchvision and upgrade torch to the newest,
        # CUDA, build (torchvision X pins torch exactly). Install the release matching your torch instead, e.g. for
        # torch 2.13: pip install "torchvision==0.28.*" (CPU torch: add --index-url
        # https://download.pytorch.org/whl/cpu); trl_flow.models.load_pipeline names this command when it is missing.
    },
)
