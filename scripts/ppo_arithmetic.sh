#!/usr/bin/env bash
# PPO with a critic (algorithm.adv_estimator=gae) from the quickstart's SFT model, on the same addition problems:
# one response per prompt, the advantage from a learned value model instead of a group of responses. Needs the
# quickstart's work directory (its SFT model, data and the SFT model's evaluation); evaluates the PPO model on the
# same held-out test problems and prints its gain over the SFT model with the paired standard error. About 30
# minutes on 2 CPU cores (docs/results.md has its result, from the quickstart's worked answers: ANSWER=worked).
#   bash scripts/quickstart.sh && bash scripts/ppo_arithmetic.sh
# Sizes are environment variables: WORK (the quickstart's; runs/quickstart), PPO_STEPS (36), PPO_PROMPTS (96 a
# step), ACTOR_LR (5e-6), CRITIC_LR (5e-5), CRITIC_WARMUP (2), NPROC (2), DTYPE (as the quickstart's: the machine's native one), and
# PPO_ARGS: more overrides.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
WORK=${WORK:-runs/quickstart} PPO_STEPS=${PPO_STEPS:-36} PPO_PROMPTS=${PPO_PROMPTS:-96} ACTOR_LR=${ACTOR_LR:-5e-6}
CRITIC_LR=${CRITIC_LR:-5e-5} CRITIC_WARMUP=${CRITIC_WARMUP:-2} NPROC=${NPROC:-2}
DTYPE=${DTYPE:-$(python -m fsdptrain.dtypes)}  # prints the machine's choice and why; an explicit DTYPE wins
SFT_MODEL=$(ls -d "$WORK"/sft/global_step_*/huggingface | sort -V | tail -1)
[ -f "$WORK/eval/sft_test.jsonl" ] || { echo "run scripts/quickstart.sh first (no $WORK/eval/sft_test.jsonl)"; exit 1; }
rm -rf "$WORK/ppo"

echo "== PPO from $SFT_MODEL: $PPO_STEPS steps of $PPO_PROMPTS prompts x 1 response, the critic warmed up for $CRITIC_WARMUP"
# One optimizer step a rollout for the actor and for the critic, as the quickstart's GRPO does; the critic's value head
# starts at random, so its first steps update the critic alone. glibc gives freed memory back here: kept for reuse,
# the actor's, critic's and engine's allocations make each process's resident memory grow step after step.
torchrun --standalone --nproc_per_node="$NPROC" -m fsdptrain.grpo_trainer \
    data.train_files="$WORK/data/rl_train.parquet" data.max_prompt_length=128 data.max_response_length=24 \
    data.train_batch_size="$PPO_PROMPTS" algorithm.adv_estimator=gae \
    actor_rollout_ref.model.path="$SFT_MODEL" actor_rollout_ref.model.enable_gradient_checkpointing=false \
    actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype="$DTYPE" \
    actor_rollout_ref.actor.optim.lr="$ACTOR_LR" actor_rollout_ref.actor.ppo_mini_batch_size="$PPO_PROMPTS" \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64 actor_rollout_ref.rollout.n=1 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=$((PPO_PROMPTS / NPROC)) \
    critic.optim.lr="$CRITIC_LR" critic.model.enable_gradient_checkpointing=false critic.ppo_micro_batch_size_per_gpu=64 \
    critic.model.fsdp_config.mixed_precision.param_dtype="$DTYPE" \
    trainer.cpu_speedups.keep_freed_host_memory=false trainer.critic_warmup="$CRITIC_WARMUP" trainer.total_training_steps="$PPO_STEPS" trainer.save_freq="$PPO_STEPS" trainer.resume_mode=disable \
    trainer.logger='["file"]' trainer.default_local_dir="$WORK/ppo" trainer.checkpoint.save_contents='[hf_model]' \
    ${PPO_ARGS:-}

echo "== Evaluation on the held-out test problems (greedy)"
OMP_NUM_THREADS=$(nproc) python -m fsdptrain.evaluate "$WORK/ppo/global_step_$PPO_STEPS/huggingface" "$WORK/data/rl_test.parquet" \
    --max-new-tokens 32 --batch-size 100 --dtype "$DTYPE" --out "$WORK/eval/ppo_test.jsonl" --summary "$WORK/eval/ppo_test.json" > /dev/null
python - "$WORK" <<'PY'
import json, os, sys
sys.path.insert(0, "scripts")
from show_result import every, paired_difference, read_jsonl
work = sys.argv[1]
print("PPO                 step  score  vf_loss  explained variance")
for m in every(read_jsonl(os.path.join(work, "ppo", "metrics.jsonl")), 6):
    print(f"{'':<18} {m['step']:>5}  {m['critic/score/mean']:>5.3f}  {m['critic/vf_loss']:>7.4f}  {m['critic/vf_explained_var']:>18.3f}")
for name in ("sft", "ppo"):
    for source, s in json.load(open(os.path.join(work, "eval", f"{name}_test.json"))).items():
        print(f"{name:<5} {source:<12} n={s['n']} acc {s['acc']:.3f} ± {s['acc_se']:.3f}")
gain, se = paired_difference(os.path.join(work, "eval", "sft_test.jsonl"), os.path.join(work, "eval", "ppo_test.jsonl"))
print(f"PPO - SFT on the same problems: {gain:+.3f} ± {se:.3f} ({gain / se if se else 0.0:+.1f} standard errors)")
PY
