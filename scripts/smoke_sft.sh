#!/usr/bin/env bash
# The short SFT smoke run to make before a real one (about 30 s on 2 CPU cores with the defaults): trains 10 steps,
# saves at step 5 with the HF export, then checks the run and exits non-zero naming the first check that fails:
# a finite loss that falls (the mean of the last 3 steps at least 10% under the first 3's), the checkpoint and its
# export loading in transformers, a validation loss, the plots.
#   bash scripts/smoke_sft.sh [extra key=value overrides ...]
# Environment: MODEL (HF folder; default: a tiny random Llama made on the spot, with a small tokenizer learned on
# the spot too: nothing to download or install beyond fsdptrain), TRAIN / VAL (parquet with a messages column;
# default: arithmetic chats), NPROC (default 2), OUT (default: a fresh temporary folder).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
NPROC=${NPROC:-2}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
if [ -z "${MODEL:-}" ]; then
    MODEL="$OUT/tiny_model"
    python scripts/make_tiny.py "$MODEL" --tokenizer trained
fi
if [ -z "${TRAIN:-}" ]; then
    python scripts/demo_data.py "$OUT/data" --rows 160
    TRAIN="$OUT/data/train.parquet" VAL="$OUT/data/val.parquet"
fi
RUN="$OUT/run"
echo "Row 0 as the trainer sees it (trained tokens in [[ ]]):"
python -m fsdptrain.data.preview "$TRAIN" --tokenizer "$MODEL" data.multiturn.enable=true data.max_length=512 data.truncation=right
torchrun --standalone --nproc_per_node="$NPROC" -m fsdptrain.sft_trainer \
    data.train_files="$TRAIN" ${VAL:+data.val_files="$VAL"} data.multiturn.enable=true \
    data.max_length=512 data.truncation=right data.train_batch_size=16 data.micro_batch_size_per_gpu=2 \
    model.partial_pretrain="$MODEL" model.enable_gradient_checkpointing=false optim.lr=5e-3 optim.lr_warmup_steps_ratio=0 optim.lr_scheduler=constant \
    trainer.total_training_steps=10 trainer.save_freq=5 trainer.test_freq=5 trainer.resume_mode=disable \
    trainer.logger='["console","file"]' trainer.default_local_dir="$RUN" \
    trainer.checkpoint.save_contents='[model,optimizer,extra,hf_model]' "$@"
python - "$RUN" <<'PY'
import json, math, os, sys
from transformers import AutoModelForCausalLM

run = sys.argv[1]

def fail(check, detail):
    sys.exit(f"SMOKE FAILED: {check}: {detail}")

with open(os.path.join(run, "metrics.jsonl")) as f:
    metrics = [json.loads(line) for line in f]
train = [m["train/loss"] for m in metrics]
if not all(math.isfinite(x) for x in train):
    fail("finite loss", f"NaN/Inf in {train}")
first, last = sum(train[:3]) / 3, sum(train[-3:]) / 3
if not last < 0.9 * first:  # batches differ, so one step's loss against another's proves nothing; 3 against 3 does
    fail("loss falls", f"mean of the first 3 steps {first:.4f}, of the last 3 {last:.4f} (needs 10% less): is the model learning?")
hf = os.path.join(run, "global_step_5", "huggingface")
if not os.path.isfile(os.path.join(hf, "config.json")):
    fail("checkpoint", f"{hf} is missing")
try:
    AutoModelForCausalLM.from_pretrained(hf)
except Exception as e:
    fail("export loads with transformers", e)
if not any(m["step"] == 5 and "val/loss" in m for m in metrics):
    fail("validation", "no val/loss at step 5")
if not os.path.isfile(os.path.join(run, "plots", "loss.png")):
    fail("plots", "no plots/loss.png")
print(f"SMOKE OK: loss {first:.4f} -> {last:.4f} (first and last 3 steps), checkpoint and HF export at step 5, val/loss and plots written")
PY
