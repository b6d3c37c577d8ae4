# From verl (https://github.com/volcengine/verl), examples/sft/gsm8k/run_qwen_05.sh at commit
# 528410c42c53107d5b28f8d071a799fffa57cdd5, unchanged below this header; Apache-2.0. tests/test_verl_keys.py runs it
# through fsdptrain with only the launcher, model, paths and sizes changed.
# Tested with 2 & 4 GPUs

set -x

if [ "$#" -lt 2 ]; then
    echo "Usage: run_qwen_05.sh <nproc_per_node> <save_path> [other_configs...]"
    exit 1
fi

nproc_per_node=$1
save_path=$2

# Shift the arguments so $@ refers to the rest
shift 2

torchrun --standalone --nnodes=1 --nproc_per_node=$nproc_per_node \
     -m verl.trainer.fsdp_sft_trainer \
    data.train_files=data/gsm8k/train.parquet \
    data.val_files=data/gsm8k/test.parquet \
    data.prompt_key=extra_info \
    data.response_key=extra_info \
    data.prompt_dict_keys=['question'] \
    +data.response_dict_keys=['answer'] \
    data.micro_batch_size_per_gpu=4 \
    model.partial_pretrain=Qwen/Qwen2.5-0.5B-Instruct \
    trainer.default_local_dir=$save_path \
    trainer.project_name=gsm8k-sft \
    trainer.experiment_name=gsm8k-sft-qwen-0.5b-it \
    trainer.total_epochs=2 \
    trainer.logger=['console'] \
    trainer.save_steps=5 \
    trainer.max_ckpt_to_keep=2 \
    trainer.default_hdfs_dir=null $@
