#!/usr/bin/env bash
# The 4-step GRPO smoke run to make before a real one: trains, saves at step 2 with the HF export, then checks
# the results and exits non-zero naming the first check that fails.
#   bash scripts/smoke_grpo.sh [extra key=value overrides ...]
# Environment: MODEL (HF folder; default: a tiny random Llama), TRAIN / VAL (RL parquet in verl's layout;
# default: arithmetic tasks), NPROC (default 2), OUT (default: a fresh temporary folder).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
NPROC=${NPROC:-2}
if [ -z "${MODEL:-}" ]; then
    MODEL="$OUT/tiny_model"
    python scripts/make_tiny.py "$MODEL"
fi
if [ -z "${TRAIN:-}" ]; then
    python scripts/make_arithmetic_data.py "$OUT/data" --train 64 --val 8 --test 8
    TRAIN="$OUT/data/rl_train.parquet" VAL="$OUT/data/rl_val.parquet"
fi
RUN="$OUT/run"
torchrun --standalone --nproc_per_node="$NPROC" -m fsdptrain.grpo_trainer \
    data.train_files="$TRAIN" ${VAL:+data.val_files="$VAL"} data.max_prompt_length=256 data.max_response_length=16 \
    data.train_batch_size=8 actor_rollout_ref.model.path="$MODEL" actor_rollout_ref.rollout.n=4 \
    actor_rollout_ref.actor.ppo_mini_batch_size=4 actor_rollout_ref.actor.use_kl_loss=true actor_rollout_ref.actor.optim.lr=1e-4 \
    trainer.total_training_steps=4 trainer.save_freq=2 trainer.test_freq=2 trainer.resume_mode=disable \
    trainer.logger='["console","file"]' trainer.default_local_dir="$RUN" trainer.rollout_data_dir="$RUN/rollouts" \
    trainer.checkpoint.save_contents='[model,optimizer,extra,hf_model]' "$@"
python - "$RUN" <<'PY'
import json, math, os, sys
from transformers import AutoModelForCausalLM

run = sys.argv[1]

def fail(check, detail):
    sys.exit(f"SMOKE FAILED: {check}: {detail}")

with open(os.path.join(run, "metrics.jsonl")) as f:
    metrics = [json.loads(line) for line in f]
if [m["step"] for m in metrics] != [1, 2, 3, 4]:
    fail("steps", f"logged {[m['step'] for m in metrics]}")
for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/kl_loss", "critic/score/mean"):
    values = [m[key] for m in metrics]
    if not all(math.isfinite(v) for v in values):
        fail("finite metrics", f"{key}: {values}")
if not any(k.startswith("val-core/") for k in metrics[1]):
    fail("validation", "no val-core/ metric at step 2")
hf = os.path.join(run, "global_step_2", "huggingface")
try:
    AutoModelForCausalLM.from_pretrained(hf)
except Exception as e:
    fail("export loads with transformers", e)
if not os.path.isfile(os.path.join(run, "rollouts", "4.jsonl")):
    fail("rollout dump", "no rollouts/4.jsonl")
print(f"SMOKE OK: 4 steps, score {metrics[0]['critic/score/mean']:.3f} -> {metrics[-1]['critic/score/mean']:.3f}, "
      "checkpoint and HF export at step 2, validation and rollouts logged")
PY
