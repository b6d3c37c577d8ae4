#!/usr/bin/env bash
# Do the asynchronous modes learn as the sync mode does? The quickstart's task (its SFT model, data and held-out
# split) trained by GRPO in each mode a seed, on the same 2 processes: the sync mode (both generate, then both
# train); separate_async with 1 training rank and 1 rollout rank, the rollout rank generating the next batch while
# the training rank trains; colocate_async, both generating and training with a batch in flight ahead, each step
# training on the first complete groups. A batch is 2 updates in every mode, the weights at most MAX_LAG steps old.
# Then the held-out accuracies, each async mode's paired difference to sync and the wall times side by side
# (docs/async.md has the results, made with the quickstart's worked answers: ANSWER=worked). A mode whose run is
# already there is not run again.
#   bash scripts/async_learning.sh
# Environment: WORK (runs/async_learning), SEEDS ("0 1"), MODES ("sync separate_async colocate_async"), MAX_LAG (1),
# and the quickstart's own variables.
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${WORK:-runs/async_learning} SEEDS=${SEEDS:-0 1} MODES=${MODES:-sync separate_async colocate_async} MAX_LAG=${MAX_LAG:-1}
DTYPE=${DTYPE:-$(python -m fsdptrain.dtypes)}
PROMPTS=${GRPO_PROMPTS:-$([ "$DTYPE" = fp32 ] && echo 32 || echo 40)}
# Both modes update twice a step (verl's rule for separate_async: train_batch_size = parameter_sync_step x mini-batch).
SHARED="actor_rollout_ref.actor.ppo_mini_batch_size=$((PROMPTS / 2))"
mkdir -p "$WORK"
SEPARATE="trainer.use_v1=true trainer.v1.trainer_mode=separate_async trainer.n_gpus_per_node=1
    actor_rollout_ref.rollout.nnodes=1 actor_rollout_ref.rollout.n_gpus_per_node=1
    trainer.v1.separate_async.parameter_sync_step=2 trainer.v1.separate_async.num_warmup_batches=$MAX_LAG
    trainer.v1.sampler.max_off_policy_threshold=$MAX_LAG"
COLOCATE="trainer.use_v1=true trainer.v1.trainer_mode=colocate_async trainer.v1.colocate_async.num_warmup_batches=1
    trainer.v1.sampler.max_off_policy_threshold=$MAX_LAG"
for seed in $SEEDS; do
    for mode in $MODES; do
        [ -f "$WORK/seed$seed/$mode/eval/grpo_test.json" ] && continue
        extra=$SHARED; [ "$mode" = separate_async ] && extra="$SHARED $SEPARATE"; [ "$mode" = colocate_async ] && extra="$SHARED $COLOCATE"
        echo "== seed $seed, $mode"
        WORK="$WORK/seed$seed/$mode" SEED=$seed DTYPE=$DTYPE GRPO_PROMPTS=$PROMPTS GRPO_ARGS="$extra ${GRPO_ARGS:-}" \
            bash scripts/quickstart.sh > "$WORK/seed$seed.$mode.log" 2>&1 || { tail -30 "$WORK/seed$seed.$mode.log"; exit 1; }
    done
done
python - "$WORK" $SEEDS <<'EOF'
import json, os, sys
sys.path.insert(0, "scripts")
from show_result import paired_difference, read_jsonl

work, seeds = sys.argv[1], sys.argv[2:]
print(f"{'seed':<5} {'mode':<15} {'acc':>6} {'GRPO-SFT':>16} {'GRPO s':>7} {'gen s':>6} {'lag mean':>8} {'lag max':>7}")
for seed in seeds:
    modes = [m for m in ("sync", "separate_async", "colocate_async") if os.path.isfile(os.path.join(work, f"seed{seed}", m, "eval", "grpo_test.json"))]
    for mode in modes:
        run = os.path.join(work, f"seed{seed}", mode)
        acc = json.load(open(os.path.join(run, "eval", "grpo_test.json")))
        acc = sum(s["acc"] * s["n"] for s in acc.values()) / sum(s["n"] for s in acc.values())
        gain, se = paired_difference(os.path.join(run, "eval", "sft_test.jsonl"), os.path.join(run, "eval", "grpo_test.jsonl"))
        steps = read_jsonl(os.path.join(run, "grpo", "metrics.jsonl"))
        lag = [m.get("async/staleness/mean", 0.0) for m in steps]
        print(f"{seed:<5} {mode:<15} {acc:>6.3f} {gain:>+8.3f} ± {se:.3f} {sum(m['timing_s/step'] for m in steps):>7.0f} "
              f"{sum(m['timing_s/gen'] for m in steps):>6.0f} {sum(lag) / len(lag):>8.2f} {max(m.get('async/staleness/max', 0) for m in steps):>7}")
    for mode in modes[1:]:
        diff, se = paired_difference(*(os.path.join(work, f"seed{seed}", m, "eval", "grpo_test.jsonl") for m in ("sync", mode)))
        print(f"seed {seed}: {mode} - sync on the same problems {diff:+.3f} ± {se:.3f} ({diff / se if se else 0.0:+.1f} SE)")
EOF
