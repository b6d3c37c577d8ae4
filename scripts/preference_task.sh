#!/usr/bin/env bash
# Recommendation RL where the reward knows what the logs do not (issue 67; docs/recommendation.md): the synthetic
# catalog of scripts/recommend_task.sh, whose users click by each leaf's popularity (the logs) but are satisfied by
# a quality order over the items' last code (make_recommendation_data.py --preference). SmolLM2-135M-Instruct is
# fine-tuned on the clicks (sliding windows, as MiniOneRec's SFT rows are), then trained by GRPO on samples
# constrained to the catalog with the user's probability of being satisfied as the reward
# (scripts/preference_reward.py); the same from each user's 8 constrained beams, with beam_pg (the beam set's policy
# gradient) and with GRPO (MiniOneRec's); the control is the SFT continued on the clicks for the sampled RL's wall
# time. The five are evaluated by constrained 10-beam search on held-out users whose targets follow the preference: HR@K
# and NDCG@K with the paired differences, and expected under the preference (recommendation_oracle.py).
#   bash scripts/preference_task.sh
# Sizes are environment variables: WORK (runs/preference), SEED (the data's draw, 0), TAU (the preference's
# temperature, 1), SFT_STEPS (125 of 16 rows), SFT_LR (2e-4, cosine to a tenth), RL_STEPS (60 of 4 prompts x 8
# samples), RL_LR (2e-5), KL (1e-3), TEST (500 users), NPROC (2), DTYPE (as the quickstart's).
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
bash scripts/setup.sh smollm2
DTYPE=${DTYPE:-$(python -m fsdptrain.dtypes)}
WORK=${WORK:-runs/preference} SEED=${SEED:-0} TAU=${TAU:-1} SFT_STEPS=${SFT_STEPS:-125} SFT_LR=${SFT_LR:-2e-4} RL_STEPS=${RL_STEPS:-60}
RL_LR=${RL_LR:-2e-5} KL=${KL:-1e-3} TEST=${TEST:-500} NPROC=${NPROC:-2}
[ -f "$WORK/smollm2/config.json" ] || python scripts/smollm2_to_hf.py "$WORK/smollm2"
python scripts/make_recommendation_data.py "$WORK/data" --test "$TEST" --seed "$SEED" --preference "$TAU" --windows
INDEX="$WORK/data/items.index.json"
rm -rf "$WORK/sft" "$WORK/rl" "$WORK/beam_pg" "$WORK/grpo_beams" "$WORK/control" "$WORK/eval"

sft() {  # OUT MODEL STEPS LR SCHEDULER [KEY=VALUE ...]: SFT on the click logs
    local out=$1 model=$2 steps=$3 lr=$4 scheduler=$5
    shift 5
    torchrun --standalone --nproc_per_node="$NPROC" -m fsdptrain.sft_trainer \
        data.train_files="$WORK/data/sft_train.parquet" data.multiturn.enable=true data.max_length=96 data.train_batch_size=16 \
        model.partial_pretrain="$model" model.enable_gradient_checkpointing=false model.fsdp_config.mixed_precision.param_dtype="$DTYPE" \
        optim.lr="$lr" optim.lr_scheduler="$scheduler" trainer.total_training_steps="$steps" trainer.test_freq=-1 trainer.resume_mode=disable \
        trainer.logger='["file"]' trainer.default_local_dir="$out" trainer.checkpoint.save_contents='[hf_model]' "$@"
}

echo "== SFT on the clicks, the catalog's tokens added: $SFT_STEPS steps of 16 rows"
start=$(date +%s)
sft "$WORK/sft" "$WORK/smollm2" "$SFT_STEPS" "$SFT_LR" cosine optim.min_lr_ratio=0.1 optim.lr_warmup_steps_ratio=0.05 \
    model.added_tokens_file="$INDEX" model.added_tokens_init=pieces
SFT_SECONDS=$(( $(date +%s) - start ))
SFT_MODEL="$WORK/sft/global_step_$SFT_STEPS/huggingface"

rl() {  # NAME [KEY=VALUE ...]: GRPO-family RL from the SFT model, the preference as the reward
    local name=$1
    shift
    torchrun --standalone --nproc_per_node="$NPROC" -m fsdptrain.grpo_trainer \
        data.train_files="$WORK/data/rl_train.parquet" data.max_prompt_length=80 data.max_response_length=8 data.train_batch_size=4 \
        actor_rollout_ref.model.path="$SFT_MODEL" actor_rollout_ref.model.enable_gradient_checkpointing=false \
        actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype="$DTYPE" \
        actor_rollout_ref.actor.optim.lr="$RL_LR" actor_rollout_ref.actor.ppo_mini_batch_size=4 \
        actor_rollout_ref.actor.use_kl_loss=true actor_rollout_ref.actor.kl_loss_coef="$KL" actor_rollout_ref.actor.kl_loss_type=low_var_kl \
        actor_rollout_ref.rollout.n=8 actor_rollout_ref.rollout.temperature=1.0 actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16 \
        actor_rollout_ref.rollout.catalog_file="$INDEX" \
        custom_reward_function.path=scripts/preference_reward.py +custom_reward_function.reward_kwargs.preference_file="$WORK/data/preference.json" \
        trainer.total_training_steps="$RL_STEPS" trainer.save_freq="$RL_STEPS" trainer.resume_mode=disable \
        trainer.logger='["file"]' trainer.default_local_dir="$WORK/$name" trainer.checkpoint.save_contents='[hf_model]' "$@"
}

echo "== RL from the SFT model: $RL_STEPS steps of 4 users x 8 samples constrained to the catalog, GRPO, the preference as the reward"
start=$(date +%s)
rl rl
RL_SECONDS=$(( $(date +%s) - start ))
echo "== beam_pg: the same over each user's 8 constrained beams, the policy gradient of the beam set's expected reward"
rl beam_pg actor_rollout_ref.rollout.beam_search=true algorithm.adv_estimator=beam_pg
echo "== GRPO over the same 8 beams (MiniOneRec's rollouts)"
rl grpo_beams actor_rollout_ref.rollout.beam_search=true

CONTROL_STEPS=$(( SFT_STEPS * RL_SECONDS / SFT_SECONDS ))
echo "== Control: the SFT continued on the clicks for the RL's wall time ($RL_SECONDS s; the SFT took $SFT_SECONDS s): $CONTROL_STEPS steps"
sft "$WORK/control" "$SFT_MODEL" "$CONTROL_STEPS" "$(python -c "print($SFT_LR / 10)")" constant
declare -A MODELS=([sft]="$SFT_MODEL" [control]="$WORK/control/global_step_$CONTROL_STEPS/huggingface")
for name in rl beam_pg grpo_beams; do MODELS[$name]="$WORK/$name/global_step_$RL_STEPS/huggingface"; done

echo "== Constrained 10-beam search on $TEST held-out users (targets: their preference)"
mkdir -p "$WORK/eval"
for name in sft rl beam_pg grpo_beams control; do
    OMP_NUM_THREADS=$(nproc) python -m fsdptrain.evaluate "${MODELS[$name]}" "$WORK/data/rl_test.parquet" --beams 10 --catalog "$INDEX" --max-new-tokens 8 \
        --batch-size 100 --dtype "$DTYPE" --out "$WORK/eval/$name.jsonl" > /dev/null
done
python scripts/recommendation_report.py "$WORK/eval" rl beam_pg grpo_beams --control control --seed "$SEED" --preference "$WORK/data/preference.json"
echo "== the whole run: $SECONDS s"
