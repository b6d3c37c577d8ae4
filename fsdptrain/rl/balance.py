"""The update's samples dealt out again over the data-parallel ranks, whole groups at a time, by their tokens.

Each rank trains on its own rollouts. Where the update leaves out the groups that teach nothing
(actor.skip_zero_advantage), a rank keeps as many groups as chance gives it, and every FSDP collective of the
update waits for the rank that kept the most. Dealing the kept groups out again evens the tokens each rank
forwards. The loss of every sample is taken over the mini-batch's global token and sequence counts, so where a
sample is trained does not change the gradient (only the order of float sums).
"""

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from fsdptrain.data.dataset import Sample
from fsdptrain.data.micro_batches import shareable_prefix, shares_prompt
from fsdptrain.distributed.mesh import Parallel


@dataclass
class Dealt:
    samples: list[Sample]  # this rank's share: copies, their `sequence` values renumbered 0.. in this list
    origins: list[tuple[int, int]]  # each one's data-parallel rank and index in that rank's list
    own: list[Sample]  # the list this rank dealt in, where return_token_values sets values back


def prompt_runs(samples: list[Sample]) -> list[list[int]]:
    """Indices of the runs of adjacent samples that a packed row holds behind one prompt (a group's responses, side
    by side as the update orders them), as the row's collation finds them."""
    runs: list[list[int]] = []
    prompt = None
    for i, sample in enumerate(samples):
        if shares_prompt(sample, prompt):
            runs[-1].append(i)
        else:
            runs.append([i])
            prompt = shareable_prefix(sample)
    return runs


def forwarded_tokens(samples: list[Sample], share_prompts: bool) -> int:
    """Tokens of a run in a packed row: its prompt once where rows share prompts."""
    total = sum(len(s) for s in samples)
    return total - (len(samples) - 1) * samples[0].shared_prefix if share_prompts else total


def deal_groups(samples: list[Sample], parallel: Parallel, share_prompts: bool) -> Dealt:
    """Every data-parallel rank's `samples` dealt out again, a prompt's run whole, largest first to the rank with
    the fewest tokens so far (every rank computes the same deal from the same gathered lists)."""
    gathered: list[list[Sample]] = [[] for _ in range(parallel.dp_size)]
    dist.all_gather_object(gathered, samples, group=parallel.dp_group)
    runs = [(rank, run) for rank, rank_samples in enumerate(gathered) for run in prompt_runs(rank_samples)]
    costs = [forwarded_tokens([gathered[rank][i] for i in run], share_prompts) for rank, run in runs]
    loads, mine = [0] * parallel.dp_size, []
    for r in sorted(range(len(runs)), key=lambda r: -costs[r]):
        to = min(range(parallel.dp_size), key=lambda rank: loads[rank])
        loads[to] += costs[r]
        if to == parallel.dp_rank:
            mine.append(r)
    origins = [(runs[r][0], i) for r in sorted(mine) for i in runs[r][1]]
    dealt = []
    for index, (rank, i) in enumerate(origins):
        sample = gathered[rank][i]
        values = {**sample.token_values, "sequence": torch.full_like(sample.token_values["sequence"], float(index))}
        dealt.append(replace(sample, token_values=values))
    return Dealt(dealt, origins, samples)


def return_token_values(dealt: Dealt, key: str, parallel: Parallel) -> None:
    """The token values `key` that training put on the dealt copies, set on the samples they came from."""
    found = {origin: sample.token_values[key] for origin, sample in zip(dealt.origins, dealt.samples) if key in sample.token_values}
    gathered: list[dict] = [{} for _ in range(parallel.dp_size)]
    dist.all_gather_object(gathered, found, group=parallel.dp_group)
    for values in gathered:
        for (rank, i), value in values.items():
            if rank == parallel.dp_rank:
                dealt.own[i].token_values[key] = value
