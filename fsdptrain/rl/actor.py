"""The policy actor: the sharded policy with its optimizer and schedule, its token log-probs of a rollout's samples,
and the clipped policy update over mini-batches. Its settings are resolved from the config once, when it is built.

Every loss term of a micro-batch is this rank's share of its mini-batch's loss over the mini-batch's global token
and sequence counts, so the gradient depends neither on the micro-batch size, the packing nor the number of ranks.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from fsdptrain.data.dataset import Sample
from fsdptrain.data.micro_batches import MicroBatch, MicroBatching, forward_batches, plan_micro_batches
from fsdptrain.distributed.mesh import Parallel
from fsdptrain.distributed.reductions import all_reduce_sum
from fsdptrain.distributed.ulysses import gather_sequence
from fsdptrain.models.added_tokens import TrainedRows
from fsdptrain.models.loss import IGNORE_INDEX, token_log_probs
from fsdptrain.models.router_balance import RouterBalance, sequence_ids, sequence_losses
from fsdptrain.optim import clipped_step
from fsdptrain.rl import core_algos
from fsdptrain.rl.balance import Dealt, deal_groups, return_token_values
from fsdptrain.rl.distillation import TEACHER_TOPK_IDS, DistillationSettings, distillation_loss


@dataclass(frozen=True)
class ForwardSettings:
    """How samples go through a model to token log-probs (the policy's and the reference's alike)."""

    packed: bool  # actor_rollout_ref.model.use_remove_padding
    share_prompts: bool
    chunked_loss_tokens: int
    temperature: float  # the rollout's: log-probs of the distribution that was sampled
    pad_id: int


@dataclass(frozen=True)
class LossSettings:
    """The policy loss (actor_rollout_ref.actor.*): `kl_coef` None without the KL loss."""

    loss_mode: str  # a name in core_algos.POLICY_LOSSES
    agg_mode: str  # a name in core_algos.LOSS_AGG_MODES: of the entropy and KL terms
    policy_agg_mode: str  # of the policy loss: agg_mode, or the one its loss always takes
    policy: core_algos.PolicyLossSettings
    entropy_coeff: float
    kl_coef: float | None
    kl_type: str
    sft_coef: float  # sft_loss_coef: the weight of the NLL of the responses scored correct (their tokens' `sft` value 1)
    loss_scale_factor: float | None
    max_response_length: int
    skip_zero_advantage: bool  # only where no term but the policy loss trains a response
    router_balance: RouterBalance | None = None  # the MoE routers' load-balancing loss, where the model's config asks for it
    distillation: DistillationSettings | None = None  # on-policy distillation's loss (the samples carry the teacher's token values)


@dataclass(frozen=True)
class UpdateSettings:
    """How the samples of a step become optimizer steps."""

    ppo_epochs: int
    mini_batch_sequences: int  # this rank's sequences a mini-batch: ppo_mini_batch_size / dp * n
    shuffle: bool
    seed: int
    grad_clip: float


@torch.no_grad()
def compute_log_probs(model: nn.Module, samples: Sequence[Sample], batching: MicroBatching, forward: ForwardSettings, parallel: Parallel,
                      key: str, with_sum_pi_squared: bool = False) -> None:
    """Each sample's log-probs of its own tokens, at the rollout temperature, through the engine's chunked path,
    stored as its token values `key` (aligned with input_ids; 0 where not trained), and with `with_sum_pi_squared`
    each position's sum of squared probabilities as `sum_pi_squared`; under Ulysses the slices are joined into
    whole rows."""
    micro_batches = plan_micro_batches(list(samples), batching, parallel)
    training = model.training
    model.eval()  # no dropout (a LoRA adapter's) in what the update's ratio divides by
    for micro_batch, batch in forward_batches(micro_batches, samples[:1], forward.packed, forward.pad_id, parallel, forward.share_prompts):
        log_probs, sum_pi_squared = token_log_probs(model, batch.inputs, batch.targets["labels"], forward.temperature, forward.chunked_loss_tokens,
                                                    sp_group=parallel.ulysses_group, token_rows=batch.token_rows,
                                                    with_sum_pi_squared=with_sum_pi_squared)
        store_token_values(log_probs, micro_batch, batch, forward.packed, parallel, key)
        if with_sum_pi_squared:
            store_token_values(sum_pi_squared, micro_batch, batch, forward.packed, parallel, "sum_pi_squared")
    model.train(training)


def store_token_values(per_position: torch.Tensor, micro_batch: list[Sample] | None, batch: MicroBatch, packed: bool, parallel: Parallel,
                       key: str) -> None:
    """A micro-batch's per-position values (log-probs, a critic's values; each at the position that predicts its
    token; a slice of every row under Ulysses: joined here, so every rank of the group calls it) stored on each of
    its samples as token values `key`, aligned with input_ids."""
    if parallel.sp_size > 1:
        per_position = gather_sequence(per_position[None], parallel.ulysses_group)[0]
    if micro_batch is None:
        return
    width = batch.inputs["input_ids"].shape[1]
    start = 0
    for row, sample in enumerate(micro_batch):
        offset = start if packed else row * width
        values = per_position[offset : offset + len(sample)].detach().cpu()
        sample.token_values[key] = torch.cat([values.new_zeros((1, *values.shape[1:])), values[:-1]])  # position t predicts token t + 1
        start += len(sample)


def has_advantage(sample: Sample) -> bool:
    """Whether any trained token of the sample has a nonzero advantage: every policy loss is the advantage times a
    function of the ratio, so a sample without one adds nothing to that loss's gradient."""
    return bool((sample.token_values["advantage"][1:] * sample.loss_mask[1:]).any())


def sequence_mean(values: torch.Tensor, mask: torch.Tensor, targets: dict[str, torch.Tensor], num_sequences: int,
                  parallel: Parallel) -> torch.Tensor:
    """On each token, the mean of `values` over its sequence's response tokens, summed over the Ulysses slices
    that hold parts of the sequence."""
    sequences = targets["sequence"].long()
    sums = core_algos.sequence_sums(values * mask, sequences, num_sequences)
    if parallel.sp_size > 1:
        dist.all_reduce(sums, group=parallel.ulysses_group)
    return sums[sequences] / targets["sequence_tokens"].clamp(min=1)


def sequence_max(values: torch.Tensor, targets: dict[str, torch.Tensor], num_sequences: int, parallel: Parallel) -> torch.Tensor:
    """On each token, the maximum of `values` over its sequence's tokens (over the Ulysses slices that hold parts of it)."""
    sequences = targets["sequence"].long()
    highest = torch.full((num_sequences,), float("-inf"), dtype=values.dtype, device=values.device)
    highest = highest.scatter_reduce(0, sequences, values, "amax")
    if parallel.sp_size > 1:
        dist.all_reduce(highest, op=dist.ReduceOp.MAX, group=parallel.ulysses_group)
    return highest[sequences]


def ranks_sum(values: torch.Tensor, parallel: Parallel) -> torch.Tensor:
    """`values` summed over every training rank (their micro-batches of the same step in the loop)."""
    values = values.clone()
    dist.all_reduce(values, group=parallel.group)
    return values


def mini_batch_aggregation(mini: list[Sample], agg_mode: str, loss_scale_factor: float | None, max_response_length: int,
                           parallel: Parallel, loss_mode: str = "vanilla") -> Callable[..., torch.Tensor]:
    """core_algos.agg_loss in `agg_mode` over the mini-batch's global token and sequence counts (every
    data-parallel rank's samples of it; the sequences as `loss_mode` counts them, core_algos.loss_rows): call it
    with a micro-batch's per-token losses, `mask` and `sequence_tokens`."""
    local = [sum(float(s.loss_mask[1:].sum()) for s in mini), core_algos.loss_rows([bool(s.loss_mask[1:].any()) for s in mini], loss_mode)]
    global_tokens, global_sequences = all_reduce_sum(local, parallel.device, parallel.dp_group)
    return partial(core_algos.agg_loss, mode=agg_mode, global_tokens=global_tokens, global_sequences=global_sequences,
                   max_response_length=max_response_length, loss_scale_factor=loss_scale_factor)


def policy_aggregation(mini: list[Sample], loss_settings: LossSettings, parallel: Parallel,
                       aggregate: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """The policy loss's aggregation: `aggregate`, the other terms', or over every row of the mini-batch for a loss
    that counts them all (GMPO, core_algos.loss_rows)."""
    if not core_algos.POLICY_LOSSES.info[loss_settings.loss_mode].every_row:
        return aggregate
    return mini_batch_aggregation(mini, loss_settings.agg_mode, loss_settings.loss_scale_factor, loss_settings.max_response_length, parallel,
                                  loss_settings.loss_mode)


def samples_to_train(mini: list[Sample], skip_zero_advantage: bool, share_prompts: bool, parallel: Parallel) -> tuple[list[Sample], Dealt | None]:
    """The samples this rank forwards: the whole mini-batch, or with `skip_zero_advantage` those with an advantage,
    dealt out again over the data-parallel ranks (each rank kept the groups chance gave it); and the deal, None
    where there was none."""
    if not skip_zero_advantage:
        return mini, None
    trained = [s for s in mini if has_advantage(s)]
    if parallel.dp_size == 1:
        return trained, None
    dealt = deal_groups(trained, parallel, share_prompts)
    return dealt.samples, dealt


def policy_tokens(log_probs: torch.Tensor, old: torch.Tensor, targets: dict[str, torch.Tensor], mask: torch.Tensor, num_sequences: int,
                  parallel: Parallel) -> core_algos.PolicyTokens:
    """A micro-batch's response tokens as the policy losses see them, with their per-sequence and every-rank reductions."""
    return core_algos.PolicyTokens(log_probs, old, targets["advantage"], mask,
                                   partial(sequence_mean, mask=mask, targets=targets, num_sequences=num_sequences, parallel=parallel),
                                   targets["sequence_tokens"], partial(sequence_max, targets=targets, num_sequences=num_sequences, parallel=parallel),
                                   partial(ranks_sum, parallel=parallel))


def policy_loss_mask(tokens: core_algos.PolicyTokens, loss_settings: LossSettings, sums: dict[str, float]) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens the policy loss aggregates and each one's count of them in its sequence: all of them, or in bypass
    mode those its rejection keeps against the current policy (their share summed into `sums`)."""
    if not loss_settings.policy.rejection:
        return tokens.mask, tokens.sequence_tokens
    kept = core_algos.bypass_kept(tokens, loss_settings.policy)
    sums["rollout_rs_masked_fraction"] = sums.get("rollout_rs_masked_fraction", 0.0) + float((tokens.mask - kept).sum())
    return kept, tokens.sequence_sum(kept)


@dataclass(frozen=True)
class RouterBalanceTerm:
    """The MoE routers' load-balancing loss in a mini-batch's update (models/router_balance.py): each sequence's weighs
    coef / (the mini-batch's sequences); its metric is summed times the mini-batch's tokens over its sequences, as the
    update divides every sum by the token count."""

    balance: RouterBalance
    sequences: float
    tokens: float
    parallel: Parallel

    @classmethod
    def of(cls, mini: list[Sample], balance: RouterBalance | None, parallel: Parallel, sums: dict[str, float]) -> "RouterBalanceTerm | None":
        if balance is None:
            return None
        sequences, tokens = all_reduce_sum([len(mini), sum(float(s.loss_mask[1:].sum()) for s in mini)], parallel.device, parallel.dp_group)
        sums["moe_load_balancing_loss"] = 0.0
        return cls(balance, sequences, tokens, parallel)

    def loss(self, router: list, inputs: dict[str, torch.Tensor], count: int, sums: dict[str, float]) -> torch.Tensor:
        """This micro-batch's term, from its `count` sequences' router logits."""
        parallel = self.parallel
        ids = sequence_ids(inputs, count, parallel.sp_rank, parallel.sp_size)
        per_sequence = sequence_losses(router, ids, count, self.balance, parallel.ulysses_group).sum()
        sums["moe_load_balancing_loss"] += float(per_sequence) * self.tokens / (self.sequences * parallel.sp_size)
        return per_sequence * (self.balance.coef / (self.sequences * parallel.sp_size))


@dataclass(frozen=True)
class SFTTerm:
    """actor.sft_loss_coef's term: a token mean of the NLL over the correct responses' tokens (their token value
    `sft` 1) of the mini-batch; its metric, that mean, is summed times the mini-batch's tokens over them, as the
    update divides every sum by the token count."""

    coef: float
    sft_tokens: float
    mini_tokens: float

    @classmethod
    def of(cls, mini: list[Sample], coef: float, parallel: Parallel, sums: dict[str, float]) -> "SFTTerm | None":
        if not coef:
            return None
        sft_tokens, mini_tokens = all_reduce_sum([sum(float((s.token_values["sft"] * s.loss_mask)[1:].sum()) for s in mini),
                                                  sum(float(s.loss_mask[1:].sum()) for s in mini)], parallel.device, parallel.dp_group)
        sums["sft_loss"] = 0.0
        return cls(coef, max(sft_tokens, 1.0), mini_tokens)

    def loss(self, log_probs: torch.Tensor, correct: torch.Tensor, sums: dict[str, float]) -> torch.Tensor:
        """This micro-batch's term, `correct` marking the correct responses' trained tokens."""
        nll = -log_probs * correct
        sums["sft_loss"] += float(nll.detach().sum()) * self.mini_tokens / self.sft_tokens
        return self.coef * nll.sum() / self.sft_tokens


def policy_forward(model: nn.Module, batch: MicroBatch, targets: dict[str, torch.Tensor], forward: ForwardSettings, parallel: Parallel,
                   router: list | None, distillation: DistillationSettings | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A micro-batch's log-probs of its tokens and entropies, and with a top-k distillation loss the log-probs of the
    teacher's top-k tokens at each position (else None), in one pass of the chunked kernel."""
    teacher_ids = targets[TEACHER_TOPK_IDS] if distillation is not None and distillation.uses_topk else None
    log_probs, entropy = token_log_probs(model, batch.inputs, targets["labels"], forward.temperature, forward.chunked_loss_tokens,
                                         with_entropy=True, sp_group=parallel.ulysses_group, token_rows=batch.token_rows, router=router,
                                         other_tokens=teacher_ids)
    if teacher_ids is None:
        return log_probs, entropy, None
    return log_probs[:, 0], entropy, log_probs[:, 1:]  # the sampled token's, then the teacher's top-k tokens'


def mini_batch_backward(model: nn.Module, mini: list[Sample], batching: MicroBatching, forward: ForwardSettings, loss_settings: LossSettings,
                        parallel: Parallel, first_pass_is_old: bool) -> dict[str, float]:
    """Gradients of one mini-batch's loss (this rank's samples of it), accumulated into the parameters; without
    old log-probs on the samples (`first_pass_is_old`) the forward's own are the old policy's (kept for the
    forwarded samples only, with loss_settings.skip_zero_advantage). Returns this rank's sums of the per-token
    metrics and its token count."""
    aggregate = mini_batch_aggregation(mini, loss_settings.agg_mode, loss_settings.loss_scale_factor, loss_settings.max_response_length,
                                       parallel)
    policy_aggregate = policy_aggregation(mini, loss_settings, parallel, aggregate)
    sums = {key: 0.0 for key in ("pg_loss", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "entropy", "kl_loss", "tokens")}
    sft = SFTTerm.of(mini, loss_settings.sft_coef, parallel, sums)
    balance = RouterBalanceTerm.of(mini, loss_settings.router_balance, parallel, sums)
    distillation = loss_settings.distillation
    trained, dealt = samples_to_train(mini, loss_settings.skip_zero_advantage, forward.share_prompts, parallel)
    # sized for the dealt copies' renumbered ids and for mini[0], which the empty pass below forwards
    num_sequences = int(max(s.token_values["sequence"][0] for s in mini + trained)) + 1
    # the loss's counts stay the whole mini-batch's; where nothing is left on any rank, one empty pass still gives
    # the optimizer zero gradients to step on (AdamW's momentum and decay), as without skipping
    micro_batches = plan_micro_batches(trained, batching, parallel) or [None]
    for micro_batch, batch in forward_batches(micro_batches, mini[:1], forward.packed, forward.pad_id, parallel, forward.share_prompts):
        targets = {k: v.flatten(0, 1) for k, v in batch.targets.items()}
        mask = (targets["labels"] != IGNORE_INDEX).float() * (0.0 if micro_batch is None else 1.0)
        router = [] if balance is not None else None
        log_probs, entropy, student_topk = policy_forward(model, batch, targets, forward, parallel, router, distillation)
        old = log_probs.detach() if first_pass_is_old else targets["old_log_prob"]
        if first_pass_is_old and "rollout_log_prob" in targets:  # kept for the engine's agreement metrics
            store_token_values(old, micro_batch, batch, forward.packed, parallel, "old_log_prob")
        tokens = policy_tokens(log_probs, old, targets, mask, num_sequences, parallel)
        pg, clipped, lower = core_algos.POLICY_LOSSES[loss_settings.loss_mode](tokens, loss_settings.policy)
        if "rollout_is_weight" in targets:
            pg = core_algos.is_weighted(pg, targets["rollout_is_weight"], loss_settings.loss_mode, tokens)
        per_token = partial(aggregate, mask=mask, sequence_tokens=targets["sequence_tokens"])
        loss = policy_aggregate(pg, *policy_loss_mask(tokens, loss_settings, sums), mode=loss_settings.policy_agg_mode)
        if loss_settings.entropy_coeff != 0:  # else the entropy is only a metric, and its backward is skipped
            loss = loss - loss_settings.entropy_coeff * per_token(entropy)
        if loss_settings.kl_coef is not None:
            kl = core_algos.kl_penalty(log_probs, targets["ref_log_prob"], loss_settings.kl_type)
            loss = loss + loss_settings.kl_coef * per_token(kl)
            sums["kl_loss"] += float((kl.detach() * mask).sum())
        if sft is not None:
            loss = loss + sft.loss(log_probs, targets["sft"] * mask, sums)
        if distillation is not None:  # without the task's rewards the distillation loss is the whole loss, as verl's
            task_loss = loss if distillation.use_task_rewards else 0.0
            loss = task_loss + distillation.weight * distillation_loss(distillation, tokens, student_topk, targets, per_token, sums)
        if balance is not None and micro_batch is not None:
            loss = loss + balance.loss(router, batch.inputs, len(micro_batch), sums)
        (loss * parallel.world_size).backward()  # FSDP averages gradients over ranks
        sums["pg_loss"] += float((pg.detach() * mask).sum())
        sums["pg_clipfrac"] += float(clipped.sum())
        sums["pg_clipfrac_lower"] += float(lower.sum())
        sums["ppo_kl"] += float(((old - log_probs.detach()) * mask).sum())
        sums["entropy"] += float((entropy.detach() * mask).sum())
        sums["tokens"] += float(mask.sum())
    if dealt is not None and first_pass_is_old and "rollout_log_prob" in mini[0].token_values:
        return_token_values(dealt, "old_log_prob", parallel)
    return sums


@dataclass
class PolicyActor:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: LRScheduler
    parallel: Parallel
    forward: ForwardSettings
    loss: LossSettings
    update_settings: UpdateSettings
    micro_batching: MicroBatching  # the update's forward passes
    log_prob_batching: MicroBatching  # the old policy's
    trained_rows: TrainedRows | None = None  # freeze_llm

    def log_probs(self, samples: Sequence[Sample], key: str, with_sum_pi_squared: bool = False) -> None:
        compute_log_probs(self.model, samples, self.log_prob_batching, self.forward, self.parallel, key, with_sum_pi_squared)

    def update(self, samples: list[Sample], first_pass_is_old: bool) -> dict[str, float]:
        """The policy's update (`run_update`). `first_pass_is_old`: the samples carry no old log-probs, the
        update's first forward is the old policy (one mini-batch, one epoch)."""
        return run_update(samples, self.update_settings, self.model, self.optimizer, self.scheduler, self.parallel, "actor",
                          lambda mini: mini_batch_backward(self.model, mini, self.micro_batching, self.forward, self.loss, self.parallel,
                                                           first_pass_is_old), self.trained_rows)


def run_update(samples: list[Sample], settings: UpdateSettings, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: LRScheduler,
               parallel: Parallel, prefix: str, backward: Callable[[list[Sample]], dict[str, float]],
               trained_rows: TrainedRows | None = None) -> dict[str, float]:
    """ppo_epochs passes over the samples' mini-batches, each `backward` (which returns its per-token metric sums
    and their token count) and one clipped optimizer step, then one step of the LR schedule. Returns the metrics
    as token means over every rank under `prefix`, with the gradient norm and the learning rate the update used."""
    lr = scheduler.get_last_lr()[0]
    totals, norms, applied_all = {}, [], True
    order = list(range(len(samples)))
    for epoch in range(settings.ppo_epochs):
        if settings.shuffle:
            order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(settings.seed + epoch)).tolist()
        for first in range(0, len(samples), settings.mini_batch_sequences):
            # sorted: a group's responses side by side, to share their prompt
            sums = backward([samples[i] for i in sorted(order[first : first + settings.mini_batch_sequences])])
            for key, value in sums.items():
                totals[key] = totals.get(key, 0.0) + value
            norm, applied = clipped_step(model, optimizer, settings.grad_clip, trained_rows)
            norms.append(norm)
            applied_all &= applied
    scheduler.step()
    totals = dict(zip(totals, all_reduce_sum(list(totals.values()), parallel.device, parallel.group)))  # per-token sums over sequence slices
    tokens = max(totals.pop("tokens"), 1.0)
    metrics = {f"{prefix}/{key}": value / tokens for key, value in totals.items()}
    metrics[f"{prefix}/grad_norm"] = sum(norms) / len(norms)
    metrics[f"{prefix}/update_skipped"] = float(not applied_all)
    metrics[f"{prefix}/lr"] = lr
    return metrics
