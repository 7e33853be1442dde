"""The embedded default model: a tiny random-weight Llama generated locally
(no hub is reachable on CI or staging sandboxes).  Deterministic: the same
seed gives the same weights, so outputs are comparable across runs."""

from __future__ import annotations

import os

DEFAULT_DIR = os.path.join(
    os.environ.get("KVSAN_CACHE", os.path.expanduser("~/.cache/kvsan")), "tiny-llama"
)


def ensure_tiny_model(path: str | None = None, seed: int = 0) -> str:
    path = path or DEFAULT_DIR
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    # CPU attention wants head_dim 64 and block sizes that are multiples of 32
    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(cfg)
    tmp = f"{path}.tmp-{os.getpid()}"
    model.save_pretrained(tmp)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        os.rename(tmp, path)
    except OSError:  # another process won the race
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return path
