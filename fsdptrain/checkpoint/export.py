"""Turn a checkpoint's sharded model into a Hugging Face folder, on one process and without an accelerator.

    python -m fsdptrain.checkpoint.export GLOBAL_STEP_DIR [--out DIR] [--dtype fp32|bf16] [--base DIR]

`--out` defaults to GLOBAL_STEP_DIR/huggingface, `--dtype` to the dtype the model was trained in. A LoRA run's
checkpoint holds its adapters alone: they are merged into the pretrained folder it was trained from (`--base`,
default the one its run read).
"""

import argparse
import os

import torch
import torch.distributed.checkpoint as dcp
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from fsdptrain.checkpoint.hf_export import save_hf_folder
from fsdptrain.checkpoint.manager import read_meta
from fsdptrain.config.shared import LoRASettings
from fsdptrain.dtypes import DTYPES
from fsdptrain.models.lora import add_adapters, merged_weights
from fsdptrain.models.vision import model_class


def export(step_dir: str, out: str, dtype: str, base: str | None = None) -> None:
    meta = read_meta(step_dir)
    if "model" not in meta["contents"]:
        raise SystemExit(f"{step_dir} holds no sharded model (contents: {meta['contents']})")
    source = os.path.join(step_dir, "huggingface")
    config = AutoConfig.from_pretrained(source)
    lora = meta.get("lora")
    if lora is None:
        model = model_class(config, AutoModelForCausalLM).from_config(config).to(DTYPES[dtype])
    else:
        base = base or lora["base_model"]
        if not os.path.isfile(os.path.join(base, "config.json")):
            raise SystemExit(f"{step_dir} holds LoRA adapters; their pretrained folder {base!r} is gone: name it with --base")
        model = model_class(config, AutoModelForCausalLM).from_pretrained(base, dtype=torch.float32)
        add_adapters(model, LoRASettings("--base", lora["rank"], lora["alpha"], lora["target_modules"], lora["exclude_modules"], 0.0), seed=0)
    saved_keys = dcp.FileSystemReader(os.path.join(step_dir, "model")).read_metadata().state_dict_metadata
    state = {k: v for k, v in model.state_dict().items() if k in saved_keys}
    dcp.load(state, checkpoint_id=os.path.join(step_dir, "model"))  # no process group: a single reader, into the model's tensors
    if lora is not None:
        state = dict(merged_weights(model, DTYPES[dtype]))
    save_hf_folder(
        out, config, GenerationConfig.from_pretrained(source), AutoTokenizer.from_pretrained(source), state, dtype, source
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step_dir", help="a global_step_N folder")
    parser.add_argument("--out", help="output folder (default: STEP_DIR/huggingface)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="weight dtype (default: the training dtype)")
    parser.add_argument("--base", help="a LoRA checkpoint's pretrained folder (default: the one its run read)")
    args = parser.parse_args()
    dtype = args.dtype or read_meta(args.step_dir)["model_dtype"]
    out = args.out or os.path.join(args.step_dir, "huggingface")
    export(args.step_dir, out, dtype, args.base)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
