"""Standalone rollout ranks (trainer.v1.trainer_mode=separate_async, verl 0.9's separate trainer): torchrun's last
ranks only generate, the others only train, and the two talk over the collective backend's point-to-point sends.

Each training rank has one rollout rank (rank T + i mod R of T training and R rollout ranks) and asks it for what
it would have generated itself: a step's batch (its prompts, the seed the synchronous run samples it with), the
validation's and the greedy baselines' answers. It asks for the batches of the next `lead` steps ahead of time
(num_warmup_batches), so that the rollout rank generates them while the trainer trains. After every step, training
rank 0 sends the new weights to every rollout rank, tagged with the policy version (the number of updates in
them). A batch request names the oldest version it may be generated with: the trained step's version minus
max_off_policy_threshold, so that no trained group lags the policy that trains on it by more than that; a rollout
rank serves its requests in order of arrival as soon as it holds weights that new, and waits for them otherwise.
At a lag of 0 the rollout ranks generate exactly what the synchronous run's ranks would (same prompts, seeds and
weights), and the run is the synchronous run.

Messages are pickled objects sent as a length and a byte tensor (tag HEADER, BODY), and the weights are host
tensors (tag WEIGHTS), all over gloo (a GPU run's backend is gloo for CPU tensors, NCCL for CUDA ones). Every send
is non-blocking and kept until it completes, so neither side waits for the other to receive.
"""

import os
import pickle
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdptrain.distributed.launcher import fault_point
from fsdptrain.distributed.mesh import Parallel
from fsdptrain.distributed.roll_call import run_store
from fsdptrain.models.lora import merged_weights
from fsdptrain.rl.data import Prompt
from fsdptrain.rl.rollout.base import Generation, RolloutEngine
from fsdptrain.rl.rollout.hf import WeightsRefresh

HEADER, BODY, WEIGHTS = 101, 102, 103
LOOK_EVERY_S = 0.02  # how often a decoding rollout rank looks for newer weights
STORE_TIMEOUT_S = 300.0  # the announcements' store: a read that waits this long means the store's host is gone


@dataclass
class Sends:
    """Non-blocking sends in flight, with the tensors they read, until they complete."""

    works: list[tuple[dist.Work, torch.Tensor]] = field(default_factory=list)

    def add(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        self.works.append((dist.isend(tensor, dst=dst, tag=tag), tensor))
        self.works = [(work, tensor) for work, tensor in self.works if not work.is_completed()]

    def wait(self) -> None:
        for work, _ in self.works:
            work.wait()
        self.works.clear()


def send_object(obj: Any, dst: int, sends: Sends) -> None:
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    sends.add(torch.tensor([len(data)], dtype=torch.int64), dst, HEADER)
    sends.add(data, dst, BODY)


def recv_object(src: int | None) -> tuple[Any, int]:
    """The next object from `src` (None: from any rank), and its sender."""
    length = torch.empty(1, dtype=torch.int64)
    sender = dist.recv(length, src=src, tag=HEADER)
    data = torch.empty(int(length), dtype=torch.uint8)
    dist.recv(data, src=sender, tag=BODY)
    return pickle.loads(data.numpy().tobytes()), sender


@dataclass(frozen=True)
class GenerateRequest:
    key: int  # a training batch's index, or a negative number for an answer (validation, greedy baselines)
    prompts: list[Prompt]
    request: Any  # sampling.RolloutRequest
    seed: int | None  # the generator's seed before generating (a training batch's, as the synchronous run's)
    min_version: int  # the oldest policy version it may be generated with


@dataclass(frozen=True)
class GenerateResult:
    key: int
    generations: list[Generation]
    version: int  # the policy version held when they began (sampling.group_versions: a group's is its first token's)
    idle_s: float  # the rollout rank's time waiting for requests or weights since its previous result


@dataclass(frozen=True)
class Sooner:
    """A batch asked for as a later step's is wanted by the current one: it may come from `min_version` on."""

    key: int
    min_version: int


@dataclass(frozen=True)
class WeightsFollow:
    version: int
    count: int  # tensors that follow, each announced by a TensorFollows


@dataclass(frozen=True)
class TensorFollows:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class Stop:
    """A training rank asks no more."""


@dataclass(frozen=True)
class Stopped:
    """The rollout rank has dropped that training rank's unanswered requests: the last message it sends it."""


ANNOUNCED = f"fsdptrain/weights_version/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"  # the latest version rank 0 has sent


def rollout_rank_of(rank: int, parallel: Parallel) -> int:
    """The rollout rank that serves training rank `rank`."""
    return parallel.world_size + rank % parallel.rollout_ranks


@dataclass
class RemoteRollout:
    """A training rank's side: its requests, the answers it has received and not yet taken, and the weights it
    sends (rank 0)."""

    parallel: Parallel
    lead: int  # batches asked for ahead of the one taken (num_warmup_batches)
    max_lag: int | None  # max_off_policy_threshold: versions a trained group may lag the trainer's; None: unbounded
    total_steps: int  # no batch is asked for beyond the run's last step
    version: int = 0  # the policy version sent last: the number of updates in it
    requested: dict[int, int] = field(default_factory=dict)  # batches asked for and not yet taken -> the oldest version asked
    received: dict[int, GenerateResult] = field(default_factory=dict)
    sends: Sends = field(default_factory=Sends)
    answers: int = 0  # answers asked for so far, for their keys
    waited: float = 0.0  # seconds spent waiting for answers, since the sampler zeroed it
    idle: float = 0.0  # the rollout rank's idle seconds reported with the answers taken since
    store: dist.Store | None = None  # rank 0's connection to the run's store, where it announces each version

    @property
    def server(self) -> int:
        return rollout_rank_of(self.parallel.rank, self.parallel)

    def batch(self, index: int, upcoming: Callable[[int], tuple[list[Prompt], int]], request: Any, steps_ahead: Callable[[int], int]) -> GenerateResult:
        """Batch `index`'s generations, asking first for it and the `lead` batches after it where not yet asked;
        `upcoming(i)`: batch i's prompts and seed, `steps_ahead(i)`: how many steps after the current one batch i
        is expected to be trained (its lag bound counts from that step's version)."""
        for ahead in range(index, index + self.lead + 1):
            if ahead in self.requested or (ahead != index and self.version + 1 + steps_ahead(ahead) > self.total_steps):
                continue
            oldest = self.oldest_version(steps_ahead(ahead))
            prompts, seed = upcoming(ahead)
            send_object(GenerateRequest(ahead, prompts, request, seed, oldest), self.server, self.sends)
            self.requested[ahead] = oldest
        now = self.oldest_version(0)
        if self.requested.pop(index) > now:  # asked for as a later step's, and taken by this one (dynamic sampling's extra batches)
            send_object(Sooner(index, now), self.server, self.sends)
        return self.take(index)

    def oldest_version(self, steps_ahead: int) -> int:
        """The oldest policy version a batch trained `steps_ahead` steps after the current one may come from: that
        step's policy (version + steps_ahead, the current step's being `version`) less max_off_policy_threshold."""
        return 0 if self.max_lag is None else max(0, self.version + steps_ahead - self.max_lag)

    def answer(self, prompts: Sequence[Prompt], request: Any) -> list[Generation]:
        """Generations for `prompts` with the weights of the current version (validation, greedy baselines)."""
        self.answers += 1
        send_object(GenerateRequest(-self.answers, list(prompts), request, None, self.version), self.server, self.sends)
        return self.take(-self.answers).generations

    def take(self, key: int) -> GenerateResult:
        start = time.perf_counter()
        while key not in self.received:
            result, _ = recv_object(self.server)
            self.received[result.key] = result
        self.waited += time.perf_counter() - start
        result = self.received.pop(key)
        self.idle += result.idle_s
        return result

    def send_weights(self, model: nn.Module, dtype: torch.dtype, bucket_bytes: int, version: int) -> None:
        """The model's full weights (a LoRA model's merged), policy version `version`, to every rollout rank:
        gathered by every training rank, sent by rank 0. The previous version's sends complete first, so that at
        most one copy is held in flight."""
        self.version = version
        parallel = self.parallel
        if parallel.is_main:
            self.sends.wait()
        # rank 0 keeps a host copy until the sends complete (the live parameters move on; a copy on the device would
        # double the model there): the weights travel through gloo
        weights = [(name, tensor.detach().to("cpu", copy=True).contiguous() if parallel.is_main else None)
                   for name, tensor in merged_weights(model, dtype, bucket_bytes=bucket_bytes)]
        if not parallel.is_main:
            return
        for server in parallel.standalone_rollout_ranks:
            send_object(WeightsFollow(version, len(weights)), server, self.sends)
            for name, tensor in weights:
                send_object(TensorFollows(name, tuple(tensor.shape), tensor.dtype), server, self.sends)
                self.sends.add(tensor, server, WEIGHTS)
        self.store = self.store or run_store(STORE_TIMEOUT_S)
        self.store.set(ANNOUNCED, str(version))  # after the sends are queued: a rank that reads it finds them coming

    def stop(self) -> None:
        """Say that this rank asks no more (rank 0: to every rollout rank, which its weights reach): each drops
        what it has not answered and says so; the answers sent before are read and left."""
        parallel = self.parallel
        servers = parallel.standalone_rollout_ranks if parallel.is_main else [self.server]
        for server in servers:
            send_object(Stop(), server, self.sends)
        for server in servers:
            while not isinstance(recv_object(server)[0], Stopped):
                pass
        self.sends.wait()


def incoming_weights(count: int) -> Iterator[tuple[str, torch.Tensor]]:
    """The `count` tensors training rank 0 sends after a WeightsFollow, each as it arrives (in host memory: the
    engine copies it to its device)."""
    for _ in range(count):
        announced, _ = recv_object(0)
        tensor = torch.empty(announced.shape, dtype=announced.dtype)
        dist.recv(tensor, src=0, tag=WEIGHTS)
        yield announced.name, tensor


@dataclass
class RolloutServer:
    """A rollout rank: it takes requests from its training ranks and weights from rank 0, and answers each request,
    in order of arrival, once it holds weights at least as new as the request asks (`generate`: the agent loops on
    `engine`), until its training ranks and rank 0 have said stop. An engine that decodes with a `refresh` (the hf
    engine) takes weights that come while it decodes between two tokens (partial rollouts): rank 0 announces each
    version in the run's key-value store, which a decoding rank reads without taking its messages in turn."""

    engine: RolloutEngine
    generate: Callable[[Sequence[Prompt], Any], list[Generation]]
    parallel: Parallel
    version: int = -1  # of the weights held: none yet
    queue: list[tuple[int, GenerateRequest]] = field(default_factory=list)
    inbox: list[tuple[Any, int]] = field(default_factory=list)  # rank 0's messages read while decoding, to handle in order
    sends: Sends = field(default_factory=Sends)
    idle: float = 0.0  # seconds waiting since the last answer
    looked: float = 0.0  # when it last looked for an announcement
    store: dist.Store = field(default_factory=lambda: run_store(STORE_TIMEOUT_S))

    def serve(self) -> None:
        parallel = self.parallel
        talking = {rank for rank in range(parallel.world_size) if rollout_rank_of(rank, parallel) == parallel.rank} | {0}
        if hasattr(self.engine, "refresh"):
            self.engine.refresh = WeightsRefresh(self.newer_weights, self.version)
        while talking:
            ready = next((i for i, (_, request) in enumerate(self.queue) if request.min_version <= self.version), None)
            if ready is not None:
                self.answer(*self.queue.pop(ready))
                continue
            waited = time.perf_counter()
            message, sender = self.inbox.pop(0) if self.inbox else recv_object(None)
            self.idle += time.perf_counter() - waited
            if isinstance(message, GenerateRequest):
                self.queue.append((sender, message))
            elif isinstance(message, Sooner):
                self.queue = [(s, replace(request, min_version=message.min_version) if (s, request.key) == (sender, message.key) else request)
                              for s, request in self.queue]
            elif isinstance(message, WeightsFollow):
                self.load(message)
            elif isinstance(message, Stop):
                self.queue = [(s, request) for s, request in self.queue if s != sender]
                send_object(Stopped(), sender, self.sends)
                talking.discard(sender)
        self.sends.wait()

    def answer(self, sender: int, request: GenerateRequest) -> None:
        if request.key >= 0:
            fault_point("rollout", request.key + 1)  # a training batch, by the step it is expected at
        if request.seed is not None:
            torch.manual_seed(request.seed)
        started = self.version  # each token carries the version that drew it; this one stands in where none is tagged
        send_object(GenerateResult(request.key, self.generate(request.prompts, request.request), started, self.idle), sender, self.sends)
        self.idle = 0.0

    def load(self, message: WeightsFollow) -> None:
        self.engine.wake_up()
        self.engine.update_weights(incoming_weights(message.count))
        self.version = message.version
        if getattr(self.engine, "refresh", None) is not None:
            self.engine.refresh.version = self.version

    def newer_weights(self) -> int | None:
        """Newer weights where rank 0 has announced some, loaded (its messages read before them kept in the inbox),
        and their version; None where none was announced (looked for every LOOK_EVERY_S at most)."""
        if time.perf_counter() - self.looked < LOOK_EVERY_S:
            return None
        self.looked = time.perf_counter()
        if not self.store.check([ANNOUNCED]) or int(self.store.get(ANNOUNCED)) <= self.version:
            return None
        while not isinstance(message := recv_object(0)[0], WeightsFollow):
            self.inbox.append((message, 0))
        self.load(message)
        return self.version

