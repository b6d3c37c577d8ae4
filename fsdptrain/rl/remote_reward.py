"""Rewards from a remote server (reward_model.remote_rm_url), in OpenRLHF's protocol (fsdptrain/reward_server.py
serves it): each response sent as its templated prompt plus its text, with its prompt and ground truth, in batches
of `batch_size`, at most `max_concurrency` requests at a time, each with a timeout. A failed request (no answer in
time, a refused connection, a status other than 200, a reply that is not one finite number per text) is retried
with exponential backoff and jitter; after the last retry the step fails naming the URL, the batch and the last
failure. A reward is never made up.
"""

import math
import random
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
from transformers import PreTrainedTokenizerBase

from fsdptrain.errors import UserError
from fsdptrain.rl.data import Prompt
from fsdptrain.rl.rollout.base import Generation


class RemoteRewardError(UserError, RuntimeError):
    """The reward server did not give a batch's rewards after every retry."""


@dataclass
class RemoteReward:
    url: str
    tokenizer: PreTrainedTokenizerBase  # the policy's: the texts sent
    batch_size: int
    max_concurrency: int
    timeout_s: float
    retries: int
    backoff_s: float
    jitter: random.Random = field(default_factory=random.Random)  # its own generator: the run's draws stay as they are

    def __call__(self, generations: Sequence[Generation], prompts: Sequence[Prompt], group_ids: Sequence[int]) -> list[float]:
        """The reward of each of this rank's responses (response i answers prompts[group_ids[i]])."""
        prompt_texts = [self.tokenizer.decode(p.ids) for p in prompts]
        rows = [{"query": prompt_texts[k] + self.tokenizer.decode(g.response_ids, skip_special_tokens=True), "prompt": prompt_texts[k],
                 "label": prompts[k].ground_truth, "data_source": prompts[k].data_source} for g, k in zip(generations, group_ids, strict=True)]
        batches = [rows[i : i + self.batch_size] for i in range(0, len(rows), self.batch_size)]
        with httpx.Client(timeout=self.timeout_s) as client, ThreadPoolExecutor(self.max_concurrency) as pool:
            replies = pool.map(lambda item: self.post(client, item[0], len(batches), item[1]), enumerate(batches))
            return [reward for rewards in replies for reward in rewards]

    def post(self, client: httpx.Client, index: int, count: int, batch: list[dict]) -> list[float]:
        payload = {"query": [r["query"] for r in batch], "prompts": [r["prompt"] for r in batch], "labels": [r["label"] for r in batch],
                   "data_sources": [r["data_source"] for r in batch]}
        failure = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1) * self.jitter.uniform(0.5, 1.5))
            try:
                reply = client.post(self.url, json=payload)
            except httpx.HTTPError as e:
                failure = f"{type(e).__name__}: {e}"
                continue
            if reply.status_code != 200:
                failure = f"status {reply.status_code}: {reply.text[:200]!r}"
                continue
            try:
                rewards = [float(r) for r in reply.json()["rewards"]]
            except (ValueError, KeyError, TypeError):
                failure = f"a reply that is not {{\"rewards\": [numbers]}}: {reply.text[:200]!r}"
                continue
            if len(rewards) != len(batch):
                failure = f"{len(rewards)} rewards for {len(batch)} texts"
            elif not all(math.isfinite(r) for r in rewards):
                failure = f"rewards that are not finite numbers: {rewards}"
            else:
                return rewards
        raise RemoteRewardError(f"reward_model.remote_rm_url={self.url}: batch {index + 1} of {count} ({len(batch)} responses, the first to "
                                f"{batch[0]['prompt'][-80:]!r}) failed {self.retries + 1} times; the last: {failure}")
