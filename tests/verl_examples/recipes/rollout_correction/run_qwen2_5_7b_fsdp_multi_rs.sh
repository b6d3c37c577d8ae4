#!/usr/bin/env bash
# Rollout correction in bypass mode, several rejection criteria chained | Qwen2.5-7B | FSDP | vLLM rollouts
#
# Written for fsdptrain in the layout of verl main's examples/rollout_correction/ (the keys its README and verl
# 0.9.1's rollout_corr_helper.py name; verl main's own script is not in this repository): the old policy's
# log-probs are the engine's (bypass_mode, no old-policy pass); in each micro-batch's loss the sequence-level
# importance weights pi / pi_rollout are normalized to a mean of 1 and the responses that leave the trust region
# are rejected when any of the chained criteria (token ratio bounds, the largest token divergence, the mean
# divergence) rejects them. Run it as verl's: the launcher, paths, model and sizes are the knobs below.
set -xeuo pipefail

MODEL_PATH=${MODEL_PATH:-Qwen/Qwen2.5-7B-Instruct}
TRAIN_FILE=${TRAIN_FILE:-$HOME/data/gsm8k/train.parquet}
TEST_FILE=${TEST_FILE:-$HOME/data/gsm8k/test.parquet}
NGPUS_PER_NODE=${NGPUS_PER_NODE:-8}

# Rollout correction
rollout_is=${ROLLOUT_IS:-sequence}
rollout_is_threshold=${ROLLOUT_IS_THRESHOLD:-2.0}
rollout_is_batch_normalize=${ROLLOUT_IS_BATCH_NORMALIZE:-true}
rollout_rs=${ROLLOUT_RS:-token_k1,seq_max_k2,seq_mean_k3}
rollout_rs_threshold=${ROLLOUT_RS_THRESHOLD:-0.5_2.0,2.5,0.01}
loss_type=${LOSS_TYPE:-reinforce}

python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    algorithm.use_kl_in_reward=False \
    algorithm.rollout_correction.bypass_mode=true \
    algorithm.rollout_correction.loss_type=${loss_type} \
    algorithm.rollout_correction.rollout_is=${rollout_is} \
    algorithm.rollout_correction.rollout_is_threshold=${rollout_is_threshold} \
    algorithm.rollout_correction.rollout_is_batch_normalize=${rollout_is_batch_normalize} \
    algorithm.rollout_correction.rollout_rs="'${rollout_rs}'" \
    algorithm.rollout_correction.rollout_rs_threshold="'${rollout_rs_threshold}'" \
    data.train_files="${TRAIN_FILE}" \
    data.val_files="${TEST_FILE}" \
    data.train_batch_size=512 \
    data.max_prompt_length=1024 \
    data.max_response_length=2048 \
    data.filter_overlong_prompts=True \
    data.truncation='error' \
    actor_rollout_ref.model.path="${MODEL_PATH}" \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=128 \
    actor_rollout_ref.actor.use_dynamic_bsz=True \
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=24576 \
    actor_rollout_ref.actor.use_kl_loss=False \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.calculate_log_probs=True \
    actor_rollout_ref.rollout.tensor_model_parallel_size=2 \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
    actor_rollout_ref.rollout.n=8 \
    trainer.critic_warmup=0 \
    trainer.logger='["console","wandb"]' \
    trainer.project_name=verl_rollout_correction \
    trainer.experiment_name=qwen2_5_7b_bypass_${rollout_is}_${rollout_rs//,/_} \
    trainer.n_gpus_per_node=${NGPUS_PER_NODE} \
    trainer.nnodes=1 \
    trainer.save_freq=50 \
    trainer.test_freq=10 \
    trainer.total_epochs=10 "$@"
