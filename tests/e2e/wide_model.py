"""A wider variant of the tiny test model for the slow-link tests and benchmark: `python -m tests.e2e.wide_model DIR`
(run with the vLLM venv's python: it needs torch and transformers).

The tiny model (bpdkv/lab/tiny_model.py) computes a prompt about as fast as this machine's veth link moves its KV, so
whether a pull pays there is a coin toss. This one keeps the tiny model's KV shape (2 layers, 2 KV heads of 64, float32:
2 KiB per token) and tokenizer, and is 4× wider (hidden 1024, intermediate 4096): P computes a prompt ~20× slower, so an
unthrottled pull clearly pays and a throttled one clearly does not.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

TINY = Path("/var/cache/bpdkv/tiny-cpu")
DEFAULT = Path("/var/cache/bpdkv/wide-cpu")


def build(out: Path = DEFAULT, tiny: Path = TINY, seed: int = 0) -> Path:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json", "chat_template.jinja"):
        if (tiny / name).exists():
            shutil.copy(tiny / name, out / name)
    base = json.loads((tiny / "config.json").read_text())
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=base["vocab_size"],
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=2,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=2048,
        torch_dtype="float32",
        eos_token_id=base.get("eos_token_id"),
        bos_token_id=base.get("bos_token_id"),
        tie_word_embeddings=False,
    )
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                continue
            param.normal_(0.0, 0.5 if name.startswith("lm_head") else 0.04)
    model.save_pretrained(str(out), safe_serialization=True)
    return out


if __name__ == "__main__":
    print(build(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT))
