#!/usr/bin/env bash
# The short GRPO smoke run to make before a real one (under a minute on 2 CPU cores with the defaults): trains 8
# steps, saves at step 4 with the HF export, then checks the run and exits non-zero naming the first check that
# fails: finite metrics, a training score that rises (the mean of the last 2 steps at least 0.1 over the first 2's),
# validation, the checkpoint's export loading in transformers, the rollout dump, the plots.
#   bash scripts/smoke_grpo.sh [extra key=value overrides ...]
# Environment: MODEL (HF folder; default: a tiny random Llama made on the spot, with a small tokenizer learned on
# the spot: nothing to download or install beyond fsdptrain), TRAIN / VAL (RL parquet in verl's layout; default:
# arithmetic prompts, rewarded by scripts/smoke_reward.py for answering in digits, which a tiny model learns in a
# few steps; with your own TRAIN, your data's reward), NPROC (default 2), OUT (default: a fresh temporary folder).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
NPROC=${NPROC:-2}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
if [ -z "${MODEL:-}" ]; then
    MODEL="$OUT/tiny_model"
    python scripts/make_tiny.py "$MODEL" --tokenizer trained
fi
REWARD=()
if [ -z "${TRAIN:-}" ]; then
    python scripts/make_arithmetic_data.py "$OUT/data" --train 64 --val 8 --test 8 > /dev/null
    TRAIN="$OUT/data/rl_train.parquet" VAL="$OUT/data/rl_val.parquet"
    REWARD=(custom_reward_function.path=scripts/smoke_reward.py)
fi
RUN="$OUT/run"
torchrun --standalone --nproc_per_node="$NPROC" -m fsdptrain.grpo_trainer \
    data.train_files="$TRAIN" ${VAL:+data.val_files="$VAL"} data.max_prompt_length=256 data.max_response_length=16 \
    data.train_batch_size=8 actor_rollout_ref.model.path="$MODEL" actor_rollout_ref.model.enable_gradient_checkpointing=false \
    actor_rollout_ref.rollout.n=8 actor_rollout_ref.actor.ppo_mini_batch_size=8 actor_rollout_ref.actor.use_kl_loss=true \
    actor_rollout_ref.actor.optim.lr=1e-2 "${REWARD[@]}" \
    trainer.total_training_steps=8 trainer.save_freq=4 trainer.test_freq=4 trainer.resume_mode=disable \
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
if [m["step"] for m in metrics] != list(range(1, 9)):
    fail("steps", f"logged {[m['step'] for m in metrics]}")
for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/kl_loss", "critic/score/mean"):
    values = [m[key] for m in metrics]
    if not all(math.isfinite(v) for v in values):
        fail("finite metrics", f"{key}: {values}")
scores = [m["critic/score/mean"] for m in metrics]
first, last = sum(scores[:2]) / 2, sum(scores[-2:]) / 2
if not last > first + 0.1:
    fail("score rises", f"mean of the first 2 steps {first:.3f}, of the last 2 {last:.3f} (needs +0.1): is the policy learning?")
if not any(k.startswith("val-core/") for k in metrics[3]):
    fail("validation", "no val-core/ metric at step 4")
hf = os.path.join(run, "global_step_4", "huggingface")
try:
    AutoModelForCausalLM.from_pretrained(hf)
except Exception as e:
    fail("export loads with transformers", e)
if not os.path.isfile(os.path.join(run, "rollouts", "8.jsonl")):
    fail("rollout dump", "no rollouts/8.jsonl")
if not os.path.isfile(os.path.join(run, "plots", "score.png")):
    fail("plots", "no plots/score.png")
print(f"SMOKE OK: score {first:.3f} -> {last:.3f} (first and last 2 steps), checkpoint and HF export at step 4, validation, "
      "rollouts and plots written")
PY
