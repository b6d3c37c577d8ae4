"""Print a finished run's losses and what the model answers before and after fine-tuning.

    python scripts/show_result.py BASE_MODEL_DIR RUN_DIR [QUESTION ...]
"""

import glob
import json
import os
import re
import sys

from transformers import AutoModelForCausalLM, AutoTokenizer

QUESTIONS = ["What is 12 plus 30?", "What is 451 plus 230?"]


def answer(model_dir: str, question: str) -> str:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    output = model.generate(**inputs, max_new_tokens=24, do_sample=False)
    return tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True).strip()


def main() -> None:
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    base, run = sys.argv[1], sys.argv[2]
    questions = sys.argv[3:] or QUESTIONS
    with open(os.path.join(run, "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f]
    print("\nstep  train/loss  val/loss")
    for m in metrics:
        val = f"{m['val/loss']:.4f}" if "val/loss" in m else ""
        print(f"{m['step']:>4}  {m['train/loss']:>10.4f}  {val:>8}")
    steps = sorted(glob.glob(os.path.join(run, "global_step_*", "huggingface")), key=lambda p: int(re.findall(r"\d+", p)[-1]))
    tuned = steps[-1]
    for question in questions:
        print(f"\nQ: {question}\n  before: {answer(base, question)}\n  after:  {answer(tuned, question)}")


if __name__ == "__main__":
    main()
