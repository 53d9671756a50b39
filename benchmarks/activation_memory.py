"""Activation memory of one transformer forward pass kept for the backward pass, per token, hidden unit and block.

Builds SD3 (MMDiT) transformers of a few widths with 2 joint blocks, runs one training forward pass on a batch of
one with a given number of image and text tokens, and sums the bytes of every tensor autograd saves for the
backward pass (``torch.autograd.graph.saved_tensors_hooks``, each storage counted once), with a LoRA on the
attention projections (only LoRA weights trainable) and with every weight trainable. The coefficient
``bytes / (tokens x hidden x blocks)`` is what docs/distributed.md scales by the real models' sizes. CPU, float32;
SDPA runs its flash kernel on CPU as on GPU (no tokens^2 attention matrix is kept).

    python benchmarks/activation_memory.py   # writes benchmarks/results/activation_memory.json
"""

from __future__ import annotations

import json
import os

import torch


def saved_bytes(model, inputs) -> int:
    seen, total = set(), [0]

    def pack(t):
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key not in seen and t.device.type == "cpu":
            seen.add(key)
            total[0] += key[1]
        return t

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(**inputs).sample
    # Weights saved for the backward pass (a matmul keeps its weight) are not activations: take them out.
    weight_bytes = sum(p.untyped_storage().nbytes() for p in model.parameters()
                       if (p.untyped_storage().data_ptr(), p.untyped_storage().nbytes()) in seen)
    del out
    assert params  # the model has parameters
    return total[0] - weight_bytes


def measure(hidden: int, latent: int, text_tokens: int, lora: bool, layers: int = 2) -> dict:
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(0)
    heads = hidden // 64 if hidden >= 64 else 1
    model = SD3Transformer2DModel(sample_size=latent, patch_size=2, in_channels=16, out_channels=16, num_layers=layers,
                                  attention_head_dim=hidden // heads, num_attention_heads=heads,
                                  joint_attention_dim=64, caption_projection_dim=hidden, pooled_projection_dim=64,
                                  pos_embed_max_size=latent)
    if lora:
        from peft import LoraConfig

        model.requires_grad_(False)
        model.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    else:
        model.requires_grad_(True)
    model.train()
    inputs = dict(hidden_states=torch.randn(1, 16, latent, latent),
                  encoder_hidden_states=torch.randn(1, text_tokens, 64),
                  pooled_projections=torch.randn(1, 64), timestep=torch.tensor([500.0]))
    tokens = (latent // 2) ** 2 + text_tokens
    b = saved_bytes(model, inputs)
    return {"hidden": hidden, "image_tokens": (latent // 2) ** 2, "text_tokens": text_tokens, "blocks": layers,
            "lora": lora, "saved_bytes": b, "bytes_per_token_hidden_block": b / (tokens * hidden * layers)}


def main():
    torch.set_num_threads(1)
    rows = [measure(h, lat, 32, lora) for h in (128, 256) for lat in (16, 32) for lora in (True, False)]
    for r in rows:
        print(r)
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "activation_memory.json")
    with open(out, "w") as f:
        json.dump({"dtype": "float32", "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
