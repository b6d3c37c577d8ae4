#!/usr/bin/env bash
# Generative recommendation as MiniOneRec trains it, on this machine, in its two stories (issue 67; docs/recommendation.md,
# docs/results.md). SmolLM2-135M-Instruct gains the 24 semantic-ID tokens of a synthetic catalog
# (scripts/make_recommendation_data.py) and is fine-tuned on sliding windows of users' histories (every position a
# target, as MiniOneRec's SFT rows are); every model is evaluated by constrained 10-beam search on held-out users
# (HR@K, NDCG@K, paired differences, and expected under the generator: scripts/recommendation_report.py), and each
# story's control is its SFT continued on its SFT data for the wall time of its RL.
#  - minionerec (this script): MiniOneRec's own story. The SFT is fitted to its validation optimum in two stages,
#    each keeping the export of least validation loss and stopping when it no longer falls (trainer.best_model):
#    SFT_STEPS at SFT_LR, then FIT_STEPS more from the first stage's best at a quarter of the rate; then trained by
#    GRPO over 8 beams constrained to the catalog with MiniOneRec's ranking reward, the SFT model as the KL's reference.
#  - preference (scripts/preference_task.sh): what users click is not what satisfies them; RL with their
#    satisfaction as the reward (GRPO on constrained samples, beam_pg and GRPO over beams).
#   bash scripts/recommend_task.sh                       # both stories
#   STORIES=minionerec bash scripts/recommend_task.sh    # one
# Sizes are environment variables: WORK (runs/recommend), SEED (the data's draw, 0), SFT_STEPS (at most 450 of 64
# rows, 2.1 epochs), SFT_LR (6e-4, cosine to a tenth), FIT_STEPS (300 more at SFT_LR / 4, cosine to a tenth),
# TEST_FREQ (validation every 25 steps), PATIENCE (3 validations; the second stage 4),
# GRPO_STEPS (60 of 4 prompts x 8 beams), GRPO_LR (1e-5), KL (1e-3), TEST (500 users), NPROC (2), DTYPE (as the
# quickstart's: bf16 where the machine computes it natively, else fp32).
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
bash scripts/setup.sh smollm2
DTYPE=${DTYPE:-$(python -m fsdptrain.dtypes)}
WORK=${WORK:-runs/recommend} SEED=${SEED:-0} STORIES=${STORIES:-minionerec preference} SFT_STEPS=${SFT_STEPS:-450} SFT_LR=${SFT_LR:-6e-4}
FIT_STEPS=${FIT_STEPS:-300}
TEST_FREQ=${TEST_FREQ:-25} PATIENCE=${PATIENCE:-3} GRPO_STEPS=${GRPO_STEPS:-60} GRPO_LR=${GRPO_LR:-1e-5} KL=${KL:-1e-3} TEST=${TEST:-500}
NPROC=${NPROC:-2}
export DTYPE SEED TEST NPROC
[ -f "$WORK/smollm2/config.json" ] || python scripts/smollm2_to_hf.py "$WORK/smollm2"

if [[ " $STORIES " == *" minionerec "* ]]; then
    STORY="$WORK/minionerec"
    python scripts/make_recommendation_data.py "$STORY/data" --test "$TEST" --seed "$SEED" --windows
    INDEX="$STORY/data/items.index.json"
    rm -rf "$STORY/sft" "$STORY/fit" "$STORY/grpo" "$STORY/control" "$STORY/eval"

    sft() {  # OUT MODEL STEPS LR SCHEDULER [KEY=VALUE ...]
        local out=$1 model=$2 steps=$3 lr=$4 scheduler=$5
        shift 5
        torchrun --standalone --nproc_per_node="$NPROC" -m fsdptrain.sft_trainer \
            data.train_files="$STORY/data/sft_train.parquet" data.multiturn.enable=true data.max_length=96 data.train_batch_size=64 \
            data.micro_batch_size_per_gpu=16 model.partial_pretrain="$model" model.enable_gradient_checkpointing=false model.fsdp_config.mixed_precision.param_dtype="$DTYPE" \
            optim.lr="$lr" optim.lr_scheduler="$scheduler" trainer.total_training_steps="$steps" trainer.resume_mode=disable \
            trainer.logger='["file"]' trainer.default_local_dir="$out" trainer.checkpoint.save_contents='[hf_model]' "$@"
    }

    echo "== minionerec: SFT on sliding windows to its validation optimum (at most $SFT_STEPS steps of 64 rows, validated every $TEST_FREQ)"
    start=$(date +%s)
    sft "$STORY/sft" "$WORK/smollm2" "$SFT_STEPS" "$SFT_LR" cosine optim.min_lr_ratio=0.1 optim.lr_warmup_steps_ratio=0.03 \
        model.added_tokens_file="$INDEX" model.added_tokens_init=pieces data.val_files="$STORY/data/sft_val.parquet" \
        trainer.test_freq="$TEST_FREQ" trainer.best_model.save=true trainer.best_model.early_stopping_patience="$PATIENCE"
    echo "SFT, first stage: the best: $(cat "$STORY/sft/best/meta.json")"
    echo "== minionerec: SFT, second stage: at most $FIT_STEPS steps more from the first stage's best at a quarter of the rate"
    sft "$STORY/fit" "$STORY/sft/best/huggingface" "$FIT_STEPS" "$(python -c "print($SFT_LR / 4)")" cosine optim.min_lr_ratio=0.1 \
        optim.lr_warmup_steps_ratio=0.03 data.val_files="$STORY/data/sft_val.parquet" trainer.test_freq="$TEST_FREQ" trainer.best_model.save=true \
        trainer.best_model.early_stopping_patience=$(( PATIENCE + 1 ))
    SFT_SECONDS=$(( $(date +%s) - start ))
    echo "SFT: $SFT_SECONDS s; the best: $(cat "$STORY/fit/best/meta.json")"
    SFT_MODEL="$STORY/fit/best/huggingface"

    echo "== minionerec: GRPO from the SFT model, $GRPO_STEPS steps of 4 users x 8 constrained beams, MiniOneRec's ranking reward"
    start=$(date +%s)
    torchrun --standalone --nproc_per_node="$NPROC" -m fsdptrain.grpo_trainer \
        data.train_files="$STORY/data/rl_train.parquet" data.max_prompt_length=80 data.max_response_length=8 data.train_batch_size=4 \
        actor_rollout_ref.model.path="$SFT_MODEL" actor_rollout_ref.model.enable_gradient_checkpointing=false \
        actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype="$DTYPE" \
        actor_rollout_ref.actor.optim.lr="$GRPO_LR" actor_rollout_ref.actor.grad_clip=0.3 actor_rollout_ref.actor.ppo_mini_batch_size=4 \
        actor_rollout_ref.actor.use_kl_loss=true actor_rollout_ref.actor.kl_loss_coef="$KL" actor_rollout_ref.actor.kl_loss_type=low_var_kl \
        actor_rollout_ref.rollout.n=8 actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16 actor_rollout_ref.rollout.beam_search=true \
        actor_rollout_ref.rollout.catalog_file="$INDEX" custom_reward_function.path=null reward.sources='[{name: ranking, function: item_ranking}]' \
        trainer.total_training_steps="$GRPO_STEPS" trainer.save_freq="$GRPO_STEPS" trainer.resume_mode=disable \
        trainer.logger='["file"]' trainer.default_local_dir="$STORY/grpo" trainer.checkpoint.save_contents='[hf_model]'
    GRPO_SECONDS=$(( $(date +%s) - start ))
    SFT_DONE=$(( $(wc -l < "$STORY/sft/metrics.jsonl") + $(wc -l < "$STORY/fit/metrics.jsonl") ))  # the steps both stages trained
    CONTROL_STEPS=$(( SFT_DONE * GRPO_SECONDS / SFT_SECONDS ))  # at the SFT's pace, its validations included
    echo "== minionerec: control, the SFT continued on its windows for the GRPO's wall time ($GRPO_SECONDS s): $CONTROL_STEPS steps"
    sft "$STORY/control" "$SFT_MODEL" "$CONTROL_STEPS" "$(python -c "print($SFT_LR / 10)")" constant

    echo "== minionerec: constrained 10-beam search on $TEST held-out users"
    mkdir -p "$STORY/eval"
    declare -A MODELS=([sft]="$SFT_MODEL" [grpo]="$STORY/grpo/global_step_$GRPO_STEPS/huggingface"
                       [control]="$STORY/control/global_step_$CONTROL_STEPS/huggingface")
    for name in sft grpo control; do
        OMP_NUM_THREADS=$(nproc) python -m fsdptrain.evaluate "${MODELS[$name]}" "$STORY/data/rl_test.parquet" --beams 10 --catalog "$INDEX" \
            --max-new-tokens 8 --batch-size 100 --dtype "$DTYPE" --out "$STORY/eval/$name.jsonl" > /dev/null
    done
    python scripts/recommendation_report.py "$STORY/eval" grpo --control control --seed "$SEED"
    echo "== minionerec: $SECONDS s so far"
fi

if [[ " $STORIES " == *" preference "* ]]; then
    mkdir -p "$WORK/preference"
    ln -sfn ../smollm2 "$WORK/preference/smollm2"
    WORK="$WORK/preference" bash scripts/preference_task.sh
fi
echo "== the whole run: $SECONDS s"
