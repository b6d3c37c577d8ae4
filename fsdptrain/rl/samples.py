"""A rollout's responses as training samples, and per-response-token values placed on them."""

from collections.abc import Sequence

import torch

from fsdptrain.data.dataset import Sample
from fsdptrain.rl.rollout.base import Generation


def aligned(values: list[float] | torch.Tensor, prompt_length: int) -> torch.Tensor:
    """Per-response-token values placed at their tokens' positions in prompt + response."""
    values = torch.as_tensor(values, dtype=torch.float32)
    return torch.cat([torch.zeros(prompt_length), values])


def make_samples(generations: Sequence[Generation], mask_truncated: bool) -> list[Sample]:
    """Prompt + response as training samples: the loss on the tokens the policy produced (none of a truncated
    response with mask_truncated_completions); each token carries its sequence's index and response token count,
    and where the engine gave them, the sampling log-probs; a vision-language model's samples, their prompt's
    images and 3-D positions."""
    samples = []
    for i, generation in enumerate(generations):
        response_mask = [0] * len(generation.response_ids) if mask_truncated and generation.truncated else generation.response_mask
        length = len(generation.prompt_ids) + len(generation.response_ids)
        values = {"sequence": torch.full((length,), float(i)), "sequence_tokens": torch.full((length,), float(sum(response_mask)))}
        if generation.log_probs is not None:
            values["rollout_log_prob"] = aligned(generation.log_probs, len(generation.prompt_ids))
        images = generation.images
        samples.append(Sample(torch.tensor(generation.prompt_ids + generation.response_ids),
                              torch.tensor([0] * len(generation.prompt_ids) + response_mask), values, shared_prefix=len(generation.prompt_ids),
                              images=images.inputs if images else None, positions=images.positions_through(length) if images else None))
    return samples
