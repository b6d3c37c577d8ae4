#!/usr/bin/env bash
# SmolLM2-135M-Instruct learns to use a calculator on 2- and 3-digit multiplication, on this machine: the model as a
# Hugging Face folder; the quickstart's SFT (worked answers, no tool) as the baseline; a short SFT on tool-use
# transcripts; multi-turn GRPO with the calculator from that SFT model; then held-out accuracy of SFT-without-tool,
# SFT-with-tool and GRPO-with-tool on the same problems, with paired standard errors (docs/results.md).
#   bash scripts/tool_task.sh
# Sizes are environment variables: WORK (runs/tool_task), SFT_STEPS (16, the quickstart's), TOOL_SFT_STEPS (3),
# GRPO_STEPS (10), GRPO_PROMPTS (8 prompts a step, 8 trajectories each), GRPO_LR (2e-5), TEST_ROWS (200),
# SEED (1: the data's and the runs'), NPROC (2), and GRPO_ARGS: more overrides for the GRPO trainer.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
WORK=${WORK:-runs/tool_task} SFT_STEPS=${SFT_STEPS:-16} TOOL_SFT_STEPS=${TOOL_SFT_STEPS:-3} GRPO_STEPS=${GRPO_STEPS:-10}
GRPO_PROMPTS=${GRPO_PROMPTS:-8} GRPO_LR=${GRPO_LR:-2e-5} TEST_ROWS=${TEST_ROWS:-200} SEED=${SEED:-1} NPROC=${NPROC:-2}
bash scripts/setup.sh smollm2
[ -f "$WORK/smollm2/config.json" ] || python scripts/smollm2_to_hf.py "$WORK/smollm2"
python scripts/make_arithmetic_data.py "$WORK/arithmetic" --train 2000 --val 32 --test 16 --seed 0
python scripts/make_tool_data.py "$WORK/data" --test "$TEST_ROWS" --seed "$SEED"
rm -rf "$WORK/sft_plain" "$WORK/sft_tool" "$WORK/grpo" "$WORK/eval"
sft() {  # OUT DATA_DIR TRAIN VAL STEPS
    torchrun --standalone --nproc_per_node="$NPROC" -m fsdptrain.sft_trainer \
        data.train_files="$2/$3" data.val_files="$2/$4" data.multiturn.enable=true data.max_length=256 data.train_batch_size=16 \
        model.partial_pretrain="$WORK/smollm2" optim.lr=5e-5 optim.lr_warmup_steps_ratio=0.1 trainer.seed="$SEED" \
        trainer.total_training_steps="$5" trainer.test_freq=-1 trainer.resume_mode=disable \
        trainer.logger='["file"]' trainer.default_local_dir="$WORK/$1" trainer.checkpoint.save_contents='[hf_model]'
}
echo "== SFT without a tool (the quickstart's): $SFT_STEPS steps of 16 chats"
sft sft_plain "$WORK/arithmetic" sft_train.parquet sft_val.parquet "$SFT_STEPS"
echo "== SFT on tool-use transcripts: $TOOL_SFT_STEPS steps of 16 chats"
sft sft_tool "$WORK/data" sft_tool_train.parquet sft_tool_val.parquet "$TOOL_SFT_STEPS"
SFT_TOOL="$WORK/sft_tool/global_step_$TOOL_SFT_STEPS/huggingface"

echo "== GRPO with the calculator: $GRPO_STEPS steps of $GRPO_PROMPTS prompts x 8 trajectories"
torchrun --standalone --nproc_per_node="$NPROC" -m fsdptrain.grpo_trainer \
    data.train_files="$WORK/data/rl_train.parquet" data.val_files="$WORK/data/rl_val.parquet" \
    data.max_prompt_length=160 data.max_response_length=96 data.train_batch_size="$GRPO_PROMPTS" \
    actor_rollout_ref.model.path="$SFT_TOOL" actor_rollout_ref.model.enable_gradient_checkpointing=false \
    actor_rollout_ref.actor.optim.lr="$GRPO_LR" actor_rollout_ref.actor.ppo_mini_batch_size="$GRPO_PROMPTS" \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16 actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32 \
    actor_rollout_ref.rollout.multi_turn.enable=true actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3 \
    actor_rollout_ref.rollout.multi_turn.tool_config_path="$WORK/data/calculator_tool.yaml" \
    reward_model.overlong_buffer.enable=true reward_model.overlong_buffer.len=32 \
    trainer.seed="$SEED" trainer.total_training_steps="$GRPO_STEPS" trainer.save_freq="$GRPO_STEPS" trainer.resume_mode=disable \
    trainer.logger='["file"]' trainer.default_local_dir="$WORK/grpo" trainer.checkpoint.save_contents='[hf_model]' \
    trainer.rollout_data_dir="$WORK/grpo/rollouts" ${GRPO_ARGS:-}

echo "== Evaluation on $TEST_ROWS held-out problems (greedy)"
mkdir -p "$WORK/eval"
evaluate() {  # NAME MODEL DATA [--tool-config ...]
    OMP_NUM_THREADS=$(nproc) python -m fsdptrain.evaluate "$2" "$3" --max-new-tokens 96 --batch-size 50 --seed "$SEED" \
        --out "$WORK/eval/$1.jsonl" --summary "$WORK/eval/$1.json" "${@:4}" > /dev/null
}
evaluate sft_without_tool "$WORK/sft_plain/global_step_$SFT_STEPS/huggingface" "$WORK/data/rl_test_plain.parquet"
evaluate sft_with_tool "$SFT_TOOL" "$WORK/data/rl_test.parquet" --tool-config "$WORK/data/calculator_tool.yaml" --max-turns 3
evaluate grpo_with_tool "$WORK/grpo/global_step_$GRPO_STEPS/huggingface" "$WORK/data/rl_test.parquet" \
    --tool-config "$WORK/data/calculator_tool.yaml" --max-turns 3
python scripts/show_tool_result.py "$WORK"
