#!/usr/bin/env bash
# Fine-tune SmolLM2-135M-Instruct on arithmetic chats with 2 processes on this machine, then show the losses
# and the model's answers before and after. About 5 minutes on 2 CPU cores.
#   bash scripts/quickstart.sh            (WORK=dir to choose where it writes; default runs/quickstart)
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${WORK:-runs/quickstart}
bash scripts/setup.sh smollm2
[ -f "$WORK/smollm2/config.json" ] || python scripts/smollm2_to_hf.py "$WORK/smollm2"
python scripts/demo_data.py "$WORK/data" --rows 256
torchrun --standalone --nproc_per_node=2 -m fsdptrain.sft_trainer \
    data.train_files="$WORK/data/train.parquet" data.val_files="$WORK/data/val.parquet" \
    data.multiturn.enable=true data.max_length=512 data.truncation=right \
    data.train_batch_size=16 \
    model.partial_pretrain="$WORK/smollm2" optim.lr=5e-5 \
    trainer.total_training_steps=8 trainer.test_freq=4 trainer.resume_mode=disable \
    trainer.logger='["console","file"]' trainer.default_local_dir="$WORK/sft" \
    trainer.checkpoint.save_contents='[hf_model]'
python scripts/show_result.py "$WORK/smollm2" "$WORK/sft"
