#!/usr/bin/env bash
# GDPO | Qwen3-8B | FSDP | vLLM rollouts
#
# Written for fsdptrain in the layout of verl main's examples/gdpo_trainer/ (the keys verl 0.9.1's GDPO estimator and
# its reward manager read; verl main's own script is not in this repository): the reward function returns a dict of
# rubric scores, the gdpo reward manager hands GDPO each of the keys algorithm.gdpo_reward_keys names, and GDPO
# normalizes each within its group before summing them. Run it as verl's: the launcher, paths, model and sizes are
# the knobs below.
set -xeuo pipefail

MODEL_PATH=${MODEL_PATH:-Qwen/Qwen3-8B}
DATA_DIR=${DATA_DIR:-$HOME/data/rlla_4k}
REWARD_FUNCTION=${REWARD_FUNCTION:-$HOME/verl/verl/utils/reward_score/rlla.py}
NGPUS_PER_NODE=${NGPUS_PER_NODE:-8}

python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=gdpo \
    +algorithm.gdpo_reward_keys='["accuracy_reward", "format_reward"]' \
    algorithm.use_kl_in_reward=False \
    data.train_files="${DATA_DIR}/train.parquet" \
    data.val_files="${DATA_DIR}/test.parquet" \
    data.train_batch_size=128 \
    data.max_prompt_length=2048 \
    data.max_response_length=1024 \
    data.filter_overlong_prompts=True \
    data.truncation='error' \
    actor_rollout_ref.model.path="${MODEL_PATH}" \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=64 \
    actor_rollout_ref.actor.use_dynamic_bsz=True \
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384 \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.tensor_model_parallel_size=2 \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
    actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.ref.fsdp_config.param_offload=True \
    reward.custom_reward_function.path="${REWARD_FUNCTION}" \
    reward.custom_reward_function.name=compute_score \
    reward.reward_manager.name=gdpo \
    trainer.critic_warmup=0 \
    trainer.logger='["console","wandb"]' \
    trainer.project_name=verl_gdpo \
    trainer.experiment_name=qwen3_8b_gdpo \
    trainer.n_gpus_per_node=${NGPUS_PER_NODE} \
    trainer.nnodes=1 \
    trainer.save_freq=50 \
    trainer.test_freq=10 \
    trainer.total_epochs=15 "$@"
