"""TRL's reference sync (`sync_ref_model`, as MiniOneRec trains with it): after every `ref_model_sync_steps`-th step
the frozen reference moves towards the policy, ref <- alpha * policy + (1 - alpha) * ref, on every parameter. The
reference is sharded as the actor (the same mesh and layer groups), so each rank mixes its own shards without a
collective. The mix is computed in fp32 and written in the reference's dtype."""

from dataclasses import dataclass

import torch
from torch import nn

from fsdptrain.distributed.fsdp import local_shard


@dataclass(frozen=True)
class ReferenceSync:
    every_steps: int  # actor_rollout_ref.ref.ref_model_sync_steps
    alpha: float  # actor_rollout_ref.ref.ref_model_mixup_alpha

    def due(self, step: int) -> bool:
        return step % self.every_steps == 0


@torch.no_grad()
def mix_policy_into_reference(reference: nn.Module, policy: nn.Module, alpha: float) -> None:
    """reference <- alpha * policy + (1 - alpha) * reference, parameter by parameter, on this rank's shards
    (wherever either model's offload keeps them)."""
    policy_parameters = dict(policy.named_parameters())
    for name, parameter in reference.named_parameters():
        mine, theirs = local_shard(parameter), local_shard(policy_parameters[name])
        mixed = torch.lerp(mine.float(), theirs.to(mine.device, torch.float32), alpha)
        mine.copy_(mixed)
