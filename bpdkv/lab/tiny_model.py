"""Build the tiny Qwen2-shaped test model locally (seeded, no downloads): `python -m bpdkv.lab.tiny_model DIR`.

Needs torch, transformers and tokenizers (the vLLM venv has them). 2 layers, hidden 256, vocab 2048, a byte-level
BPE tokenizer trained on generated text with Qwen2's pre-tokenizer split and a ChatML chat template, so
transformers 5 (which always loads Qwen2Tokenizer for model_type qwen2) encodes the same way.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN2_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
WORDS = (
    "the model cache block token prefill decode transfer router reuse history turn answer question data fast slow "
    "layer head value key network node engine request stream agent tool call result system user assistant plan"
).split()


def corpus(seed: int = 0, lines: int = 4000) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 20))) + rng.choice([".", "?", "!", ""]) for _ in range(lines)]


def build(out: Path, seed: int = 0) -> Path:
    import torch
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    if (out / "config.json").exists() and (out / "tokenizer.json").exists() and (out / "model.safetensors").exists():
        return out
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=2048, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(seed), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=2048,
        torch_dtype="float32",
        eos_token_id=fast.convert_tokens_to_ids("<|im_end|>"),
        bos_token_id=fast.convert_tokens_to_ids("<|endoftext|>"),
        tie_word_embeddings=False,
    )
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                continue
            param.normal_(0.0, 0.5 if name.startswith("lm_head") else 0.08)
    model.save_pretrained(str(out), safe_serialization=True)
    (out / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    return out


if __name__ == "__main__":
    print(build(Path(sys.argv[1] if len(sys.argv) > 1 else "/var/cache/bpdkv/tiny-cpu")))
