#!/usr/bin/env bash
# Generative recommendation as MiniOneRec trains it, on this machine: SmolLM2-135M-Instruct gains the 24 semantic-ID
# tokens of a synthetic catalog (scripts/make_recommendation_data.py), is fine-tuned to name a user's next item,
# then trained by GRPO over 8 beams constrained to the catalog with MiniOneRec's ranking reward, against the SFT
# model as the KL's reference; both are evaluated by constrained 10-beam search on held-out users (HR@K, NDCG@K),
# with GRPO's paired difference from SFT, and both against the generator's Bayes ranking. Its SFT learns the users'
# rule (HR@10 0.65 on the 200 validation users, a random pick's 0.04); its GRPO does not yet improve on it
# (docs/results.md has the runs and what the Bayes ranking says of them).
#   bash scripts/recommend_task.sh
# Sizes are environment variables: WORK (runs/recommend), SEED (the data's draw, 0), SFT_STEPS (125 of 16 users),
# SFT_LR (2e-4, cosine to a tenth), GRPO_STEPS (100 of 4 prompts x 8 beams), GRPO_LR (1e-5), KL (1e-3), TEST (500 users), NPROC (2),
# DTYPE (as the quickstart's: bf16 where the machine computes it natively, else fp32).
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
bash scripts/setup.sh smollm2
DTYPE=${DTYPE:-$(python -m fsdptrain.dtypes)}
WORK=${WORK:-runs/recommend} SEED=${SEED:-0} SFT_STEPS=${SFT_STEPS:-125} SFT_LR=${SFT_LR:-2e-4} GRPO_STEPS=${GRPO_STEPS:-100}
GRPO_LR=${GRPO_LR:-1e-5} KL=${KL:-1e-3} TEST=${TEST:-500} NPROC=${NPROC:-2}
[ -f "$WORK/smollm2/config.json" ] || python scripts/smollm2_to_hf.py "$WORK/smollm2"
python scripts/make_recommendation_data.py "$WORK/data" --test "$TEST" --seed "$SEED"
INDEX="$WORK/data/items.index.json"
rm -rf "$WORK/sft" "$WORK/grpo" "$WORK/eval"

echo "== SFT with the catalog's tokens added: $SFT_STEPS steps of 16 users"
torchrun --standalone --nproc_per_node="$NPROC" -m fsdptrain.sft_trainer \
    data.train_files="$WORK/data/sft_train.parquet" data.multiturn.enable=true data.max_length=96 data.train_batch_size=16 \
    model.partial_pretrain="$WORK/smollm2" model.added_tokens_file="$INDEX" model.added_tokens_init=pieces model.enable_gradient_checkpointing=false \
    model.fsdp_config.mixed_precision.param_dtype="$DTYPE" optim.lr="$SFT_LR" optim.lr_scheduler=cosine optim.min_lr_ratio=0.1 optim.lr_warmup_steps_ratio=0.05 \
    trainer.total_training_steps="$SFT_STEPS" trainer.test_freq=-1 trainer.resume_mode=disable \
    trainer.logger='["file"]' trainer.default_local_dir="$WORK/sft" trainer.checkpoint.save_contents='[hf_model]'
SFT_MODEL="$WORK/sft/global_step_$SFT_STEPS/huggingface"

echo "== GRPO from the SFT model: $GRPO_STEPS steps of 4 users x 8 constrained beams, ranking reward"
torchrun --standalone --nproc_per_node="$NPROC" -m fsdptrain.grpo_trainer \
    data.train_files="$WORK/data/rl_train.parquet" data.max_prompt_length=80 data.max_response_length=8 data.train_batch_size=4 \
    actor_rollout_ref.model.path="$SFT_MODEL" actor_rollout_ref.model.enable_gradient_checkpointing=false \
    actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype="$DTYPE" \
    actor_rollout_ref.actor.optim.lr="$GRPO_LR" actor_rollout_ref.actor.grad_clip=0.3 actor_rollout_ref.actor.ppo_mini_batch_size=4 \
    actor_rollout_ref.actor.use_kl_loss=true actor_rollout_ref.actor.kl_loss_coef="$KL" actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.rollout.n=8 actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16 actor_rollout_ref.rollout.beam_search=true actor_rollout_ref.rollout.catalog_file="$INDEX" \
    custom_reward_function.path=null reward.sources='[{name: ranking, function: item_ranking}]' \
    trainer.total_training_steps="$GRPO_STEPS" trainer.save_freq="$GRPO_STEPS" trainer.resume_mode=disable \
    trainer.logger='["file"]' trainer.default_local_dir="$WORK/grpo" trainer.checkpoint.save_contents='[hf_model]'
GRPO_MODEL="$WORK/grpo/global_step_$GRPO_STEPS/huggingface"

echo "== Constrained 10-beam search on $TEST held-out users"
mkdir -p "$WORK/eval"
declare -A MODELS=([sft]="$SFT_MODEL" [grpo]="$GRPO_MODEL")
pids=()
for name in sft grpo; do  # side by side, a thread each
    python -m fsdptrain.evaluate "${MODELS[$name]}" "$WORK/data/rl_test.parquet" --beams 10 --catalog "$INDEX" --max-new-tokens 8 --batch-size 200 \
        --dtype "$DTYPE" --out "$WORK/eval/$name.jsonl" > /dev/null &
    pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid"; done
python - "$WORK/eval" <<'PY'
import json, sys
from fsdptrain.evaluate import report_ranking
records = lambda name: [json.loads(line) for line in open(f"{sys.argv[1]}/{name}.jsonl")]
print("SFT:", end="")
report_ranking(records("sft"), [1, 5, 10], None)
print("\nGRPO, and its paired difference from SFT:", end="")
report_ranking(records("grpo"), [1, 5, 10], f"{sys.argv[1]}/sft.jsonl")
PY
for name in sft grpo; do  # against the generator's own (Bayes) ranking, and as expected under it: no draw's noise
    echo "== $name against the Bayes ranking"
    python scripts/recommendation_oracle.py "$WORK/eval/$name.jsonl" --seed "$SEED"
done
