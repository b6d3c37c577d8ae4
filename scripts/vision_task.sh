#!/usr/bin/env bash
# A vision-language model learns what only its image says, on this machine: images of a coloured square on a
# background of another colour ("What colour is the square?", scripts/make_shape_data.py), a tiny random Qwen2.5-VL
# (decoder and vision tower from transformers' config classes, SmolLM2's tokenizer: each colour one token), SFT that
# trains the tower with the decoder, GRPO from the SFT model with the colour as the reward, then both models'
# held-out accuracy on the same images with GRPO's paired gain (docs/results.md).
#   bash scripts/vision_task.sh
# Sizes are environment variables: WORK (runs/vision_task), SEED (0: the images', the model's and the runs'),
# SFT_STEPS (750), SFT_LR (1e-3), GRPO_STEPS (150), GRPO_PROMPTS (32 a step, 8 responses each), GRPO_LR (3e-4),
# TEST_ROWS (500), LAYERS (4) and WIDTH (128, the decoder's; the tower is half as wide), NPROC (2).
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
WORK=${WORK:-runs/vision_task} SEED=${SEED:-0} SFT_STEPS=${SFT_STEPS:-750} SFT_LR=${SFT_LR:-1e-3} GRPO_STEPS=${GRPO_STEPS:-150}
GRPO_PROMPTS=${GRPO_PROMPTS:-32} GRPO_LR=${GRPO_LR:-3e-4} TEST_ROWS=${TEST_ROWS:-500} LAYERS=${LAYERS:-4} WIDTH=${WIDTH:-128} NPROC=${NPROC:-2}
bash scripts/setup.sh smollm2
rm -rf "$WORK"
python scripts/make_shape_data.py "$WORK/data" --train 2000 --test "$TEST_ROWS" --seed "$SEED"
python scripts/make_tiny.py "$WORK/model" --arch qwen2_5_vl --seed "$SEED" --layers "$LAYERS" --width "$WIDTH"
REWARD=(custom_reward_function.path="$WORK/data/reward.py" custom_reward_function.name=compute_score)

echo "== SFT: $SFT_STEPS steps of 16 images, the tower trained with the decoder"
torchrun --standalone --nproc_per_node="$NPROC" -m fsdptrain.sft_trainer \
    data.train_files="$WORK/data/sft_train.parquet" data.multiturn.enable=true data.max_length=128 data.train_batch_size=16 \
    model.partial_pretrain="$WORK/model" model.enable_gradient_checkpointing=false model.fsdp_config.mixed_precision.param_dtype=fp32 \
    optim.lr="$SFT_LR" trainer.seed="$SEED" trainer.total_training_steps="$SFT_STEPS" trainer.test_freq=-1 trainer.resume_mode=disable \
    trainer.logger='["file"]' trainer.default_local_dir="$WORK/sft" trainer.checkpoint.save_contents='[hf_model]'
SFT_MODEL="$WORK/sft/global_step_$SFT_STEPS/huggingface"

echo "== GRPO from the SFT model: $GRPO_STEPS steps of $GRPO_PROMPTS images x 8 responses"
torchrun --standalone --nproc_per_node="$NPROC" -m fsdptrain.grpo_trainer \
    data.train_files="$WORK/data/rl_train.parquet" data.image_key=images data.max_prompt_length=96 data.max_response_length=4 \
    data.train_batch_size="$GRPO_PROMPTS" actor_rollout_ref.model.path="$SFT_MODEL" actor_rollout_ref.model.enable_gradient_checkpointing=false \
    actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp32 actor_rollout_ref.actor.optim.lr="$GRPO_LR" \
    actor_rollout_ref.actor.ppo_mini_batch_size="$GRPO_PROMPTS" actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64 \
    actor_rollout_ref.actor.skip_zero_advantage=true actor_rollout_ref.rollout.n=8 actor_rollout_ref.rollout.temperature=1.0 "${REWARD[@]}" \
    trainer.seed="$SEED" trainer.total_training_steps="$GRPO_STEPS" trainer.save_freq="$GRPO_STEPS" trainer.resume_mode=disable \
    trainer.logger='["file"]' trainer.default_local_dir="$WORK/grpo" trainer.checkpoint.save_contents='[hf_model]'
GRPO_MODEL="$WORK/grpo/global_step_$GRPO_STEPS/huggingface"

echo "== Evaluation on $TEST_ROWS held-out images (greedy)"
mkdir -p "$WORK/eval"
for name in sft grpo; do
    model=$SFT_MODEL; [ "$name" = grpo ] && model=$GRPO_MODEL
    python -m fsdptrain.evaluate "$model" "$WORK/data/rl_test.parquet" --max-new-tokens 4 --batch-size 100 "${REWARD[@]}" \
        --out "$WORK/eval/$name.jsonl" --summary "$WORK/eval/$name.json" | grep -A1 "^data_source" | sed "s/^/$name  /"
done
PYTHONPATH=scripts python -c "
from show_result import paired_difference
gain, se = paired_difference('$WORK/eval/sft.jsonl', '$WORK/eval/grpo.jsonl')
print(f'GRPO - SFT on the same images: {gain:+.3f} ± {se:.3f} ({gain / se if se else 0.0:+.1f} standard errors)')"
