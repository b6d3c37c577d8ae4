"""The distillation teacher (rl/distillation.py) on the training ranks, as the reference runs: sharded, frozen,
offloadable between its forwards. It scores at temperature 1, so its log-probs are those of its own distribution,
as verl's prompt log-probs from the teacher's server."""

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import nn

from fsdptrain.data.dataset import Sample
from fsdptrain.data.micro_batches import MicroBatching, forward_batches, plan_micro_batches
from fsdptrain.distributed.mesh import Parallel
from fsdptrain.distributed.offload import PhaseOffload
from fsdptrain.models.loss import token_top_k
from fsdptrain.rl.actor import ForwardSettings, compute_log_probs, store_token_values
from fsdptrain.rl.distillation import TEACHER_LOG_PROB, TEACHER_TOPK_IDS, TEACHER_TOPK_LOG_PROBS, DistillationSettings


@dataclass
class Teacher:
    """The frozen teacher on the training ranks, and how it scores the policy's samples."""

    model: nn.Module
    batching: MicroBatching  # distillation.teacher_models.teacher_model.log_prob_micro_batch_size_per_gpu
    offload: PhaseOffload
    settings: DistillationSettings
    share_prompts: bool  # the teacher's architecture computes a shared prompt right (models/architecture.py)

    def score(self, samples: Sequence[Sample], forward: ForwardSettings, parallel: Parallel) -> None:
        """The teacher's token values on each sample: its log-prob of each sampled token, or its top-k log-probs and
        ids at each position (forward_kl_topk); at temperature 1, through the actor's packing (`forward`)."""
        forward = replace(forward, temperature=1.0, share_prompts=forward.share_prompts and self.share_prompts)
        self.offload.params_back()
        if self.settings.uses_topk:
            compute_top_k(self.model, samples, self.batching, forward, parallel, self.settings.topk)
        else:
            compute_log_probs(self.model, samples, self.batching, forward, parallel, TEACHER_LOG_PROB)
        self.offload.leave()


@torch.no_grad()
def compute_top_k(model: nn.Module, samples: Sequence[Sample], batching: MicroBatching, forward: ForwardSettings, parallel: Parallel, k: int) -> None:
    """Each sample's teacher top-k at each of its tokens (the k tokens most likely there, their log-probs) as its
    token values TEACHER_TOPK_LOG_PROBS and TEACHER_TOPK_IDS, aligned as compute_log_probs aligns log-probs."""
    model.eval()
    for micro_batch, batch in forward_batches(plan_micro_batches(list(samples), batching, parallel), samples[:1], forward.packed, forward.pad_id,
                                              parallel, forward.share_prompts):
        values, ids = token_top_k(model, batch.inputs, batch.targets["labels"], k, forward.chunked_loss_tokens, sp_group=parallel.ulysses_group,
                                  token_rows=batch.token_rows)
        store_token_values(values, micro_batch, batch, forward.packed, parallel, TEACHER_TOPK_LOG_PROBS)
        store_token_values(ids, micro_batch, batch, forward.packed, parallel, TEACHER_TOPK_IDS)
