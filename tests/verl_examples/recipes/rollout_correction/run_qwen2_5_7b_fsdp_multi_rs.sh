#!/usr/bin/env bash
# Rollout correction in bypass mode, several rejection criteria chained | Qwen2.5-7B | FSDP | vLLM rollouts
#
# run_qwen2_5_7b_fsdp.sh with three rejection criteria, each of which must pass: the token's ratio within bounds,
# the largest token divergence of the response (k2) and its mean divergence (k3).
set -xeuo pipefail

ROLLOUT_RS=${ROLLOUT_RS:-token_k1,seq_max_k2,seq_mean_k3} \
ROLLOUT_RS_THRESHOLD=${ROLLOUT_RS_THRESHOLD:-0.5_2.0,2.5,0.01} \
    bash "$(dirname "$0")/run_qwen2_5_7b_fsdp.sh" "$@"
