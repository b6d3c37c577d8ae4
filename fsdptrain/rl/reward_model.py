"""A reward model's scores of a rollout: a Hugging Face sequence-classification checkpoint with one label, built as
transformers' token classification (the same `score` head, read at every position) so that packed rows work, sharded
with FSDP2 and frozen like the reference. A response's score is the head's output at the last token of prompt +
response, as the sequence-classification model's own pooling reads it.

Where the reward model's tokenizer is not the policy's (another vocabulary or chat template), each conversation is
decoded and templated again with the reward model's own: the prompt's messages and the response as the assistant's
turn. Otherwise the policy's token ids are scored as they are, with a vision-language policy's images (a reward model
of its type that reads them as it does: trainer/grpo.py checks it at start).
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from fsdptrain.data.dataset import Sample
from fsdptrain.data.micro_batches import MicroBatching, forward_batches, plan_micro_batches
from fsdptrain.distributed.mesh import Parallel
from fsdptrain.distributed.offload import PhaseOffload
from fsdptrain.rl.actor import store_token_values
from fsdptrain.rl.critic import token_values
from fsdptrain.rl.data import Prompt
from fsdptrain.rl.rollout.base import Generation


def same_tokenizer(a: PreTrainedTokenizerBase, b: PreTrainedTokenizerBase) -> bool:
    return a.get_vocab() == b.get_vocab() and a.chat_template == b.chat_template


@dataclass
class RewardModel:
    model: nn.Module  # token classification with one label, frozen
    parallel: Parallel
    batching: MicroBatching
    packed: bool
    pad_id: int  # the reward model's
    policy_tokenizer: PreTrainedTokenizerBase
    tokenizer: PreTrainedTokenizerBase | None  # the reward model's own, where it differs from the policy's
    offload: PhaseOffload  # verl's param_offload: its shards in host memory except during its forward

    def token_ids(self, generation: Generation, prompt: Prompt) -> list[int]:
        if self.tokenizer is None:
            return generation.prompt_ids + generation.response_ids
        response = self.policy_tokenizer.decode(generation.response_ids, skip_special_tokens=True)
        messages = [*prompt.messages, {"role": "assistant", "content": response}]
        return list(self.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"])

    @torch.no_grad()
    def __call__(self, generations: Sequence[Generation], prompts: Sequence[Prompt], group_ids: Sequence[int]) -> list[float]:
        """The score of each of this rank's responses (response i answers prompts[group_ids[i]]). Every rank calls
        it (a rank with fewer micro-batches runs discarded forwards for FSDP's collectives)."""
        samples = []
        for generation, group in zip(generations, group_ids, strict=True):
            ids = self.token_ids(generation, prompts[group])
            # One padding token after the sequence, as its only target: the head's output at the position that
            # predicts it is the output at the sequence's last token (causal attention: the extra token changes nothing before it).
            images = generation.images  # only where the policy's ids are scored as they are (resolved at start)
            samples.append(Sample(torch.tensor([*ids, self.pad_id]), torch.tensor([0] * len(ids) + [1]), images=images.inputs if images else None,
                                  positions=images.positions_through(len(ids) + 1) if images else None))
        micro_batches = plan_micro_batches(samples, self.batching, self.parallel)
        self.offload.params_back()
        for micro_batch, batch in forward_batches(micro_batches, samples[:1], self.packed, self.pad_id, self.parallel):
            scores = token_values(self.model, batch.inputs, batch.targets["labels"], batch.token_rows, None)
            store_token_values(scores, micro_batch, batch, self.packed, self.parallel, "score")
        self.offload.leave()
        return [float(sample.token_values["score"][-1]) for sample in samples]
