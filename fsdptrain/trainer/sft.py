"""Supervised fine-tuning: the step loop on top of the shared set-up."""

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from fsdptrain.data.batching import epoch_batches, rank_share
from fsdptrain.data.dataset import Sample, check_files_exist, load_sft_samples
from fsdptrain.data.images import image_reader
from fsdptrain.data.micro_batches import collate, forward_batches, loss_tokens, plan_micro_batches
from fsdptrain.distributed.mesh import Parallel
from fsdptrain.distributed.reductions import all_reduce_sum, max_over_ranks, once_per_sp_group
from fsdptrain.logging.plots import write_plots
from fsdptrain.logging.profiler import profile_step
from fsdptrain.models.added_tokens import AddedTokens, add_model_tokens
from fsdptrain.models.loading import load_model_config, load_tokenizer
from fsdptrain.models.loss import token_nll_sum
from fsdptrain.models.router_balance import RouterBalance, router_balance, sequence_ids, sequence_losses
from fsdptrain.optim import clipped_step
from fsdptrain.trainer.best_model import BestModel
from fsdptrain.trainer.runtime import log, peak_memory_gb
from fsdptrain.trainer.setup import StepTimer, claim_run_directory, count_steps, lost_ranks_named, open_run, start_run
from fsdptrain.trainer.sft_plan import SFTPlan


def train_step(model: nn.Module, micro_batches: list[list[Sample] | None], plan: SFTPlan, parallel: Parallel, pad_token_id: int,
               balance: RouterBalance | None = None) -> list[float]:
    """Forward and backward of one optimizer step's micro-batches. Returns this rank's [nll sum, tokens, seen tokens,
    summed per-sequence load-balancing loss].

    Gradients are those of the loss below; FSDP averages over all ranks, so each rank's loss is scaled by the
    world size. balance_dp_token=true: every loss token of the step weighs 1 / (its global count).
    false: verl's mean over micro-batches and DP ranks of each micro-batch's token mean. With the MoE routers'
    `balance` loss, each sequence's adds coef / (the step's sequences) (models/router_balance.py).
    """
    global_tokens, global_sequences = all_reduce_sum([sum(loss_tokens(mb) for mb in micro_batches), sum(len(mb or []) for mb in micro_batches)],
                                                     parallel.device, parallel.dp_group)
    # The nll sum stays on the device until the end: reading it after each backward would make the host wait for
    # the GPU before collating the next micro-batch, leaving the GPU idle meanwhile.
    nll_total, balance_total, tokens_total, seen = torch.zeros((), device=parallel.device), torch.zeros((), device=parallel.device), 0, 0
    for micro_batch in micro_batches:
        batch = collate(micro_batch, plan.model.packed, pad_token_id, parallel)
        router = [] if balance is not None else None
        nll = token_nll_sum(model, batch.inputs, batch.targets["labels"], plan.chunked_loss_tokens, parallel.ulysses_group, router)
        tokens = loss_tokens(micro_batch)
        if plan.balance_dp_token:
            denominator = max(global_tokens, 1.0)
        else:
            denominator = max(tokens, 1) * len(micro_batches) * parallel.dp_size
        loss = nll * (parallel.world_size / denominator)
        if balance is not None:
            ids = sequence_ids(batch.inputs, len(micro_batch), parallel.sp_rank, parallel.sp_size)
            per_sequence = sequence_losses(router, ids, len(micro_batch), balance, parallel.ulysses_group).sum()
            loss = loss + per_sequence * (balance.coef * parallel.world_size / (global_sequences * parallel.sp_size))
            balance_total += per_sequence.detach()
        loss.backward()
        nll_total += nll.detach()
        tokens_total += tokens
        seen += sum(len(s) for s in micro_batch)
    return [float(nll_total), tokens_total, seen, float(balance_total)]


@torch.no_grad()
def validate(model: nn.Module, samples: Sequence[Sample], plan: SFTPlan, parallel: Parallel, pad_token_id: int) -> float:
    """Token-mean loss over the whole validation set, each sample counted once."""
    model.eval()
    mine = list(samples[parallel.dp_rank :: parallel.dp_size])
    nll_total, tokens_total = 0.0, 0
    micro_batches = plan_micro_batches(mine, plan.micro_batching, parallel)
    for micro_batch, batch in forward_batches(micro_batches, samples[:1], plan.model.packed, pad_token_id, parallel):
        nll = token_nll_sum(model, batch.inputs, batch.targets["labels"], plan.chunked_loss_tokens, parallel.ulysses_group)
        if micro_batch is not None:
            nll_total += float(nll)
            tokens_total += loss_tokens(micro_batch)
    model.train()
    nll_sum, token_sum = all_reduce_sum([nll_total, *once_per_sp_group([tokens_total], parallel)], parallel.device)
    return nll_sum / max(token_sum, 1.0)


@dataclass
class SFTInputs:
    """What an SFT run reads before its processes work together: each is checked, and a problem is the user's
    before any rank has started (fsdptrain.check reads the same)."""

    plan: SFTPlan
    hf_config: PretrainedConfig
    tokenizer: PreTrainedTokenizerBase
    train: list[Sample]
    val: list[Sample]
    total_steps: int
    added: AddedTokens | None  # model.added_tokens_file's


def read_sft_inputs(plan: SFTPlan) -> SFTInputs:
    data, spec = plan.data, plan.model
    check_files_exist({"data.train_files": data.train_files, "data.val_files": data.val_files})
    hf_config = load_model_config(spec.path, "model.partial_pretrain", spec.model, plan.sp_size)
    tokenizer = load_tokenizer(spec.path, "model.partial_pretrain", spec.model)
    added = add_model_tokens(spec.model, "model", tokenizer, hf_config)
    images = image_reader(spec.path, "model.partial_pretrain", data.image_key, tokenizer, hf_config, spec.model.trust_remote_code)
    train = load_sft_samples(data.train_files, tokenizer, data, images)
    val = load_sft_samples(data.val_files, tokenizer, data, images) if data.val_files else []
    total_steps = count_steps(plan.trainer, len(train), data.train_batch_size, "samples")
    return SFTInputs(plan, hf_config, tokenizer, train, val, total_steps, added)


def run_sft(plan: SFTPlan) -> None:
    inputs = read_sft_inputs(plan)
    hf_config, tokenizer, train, val, total_steps = inputs.hf_config, inputs.tokenizer, inputs.train, inputs.val, inputs.total_steps
    trainer, data = plan.trainer, plan.data
    parallel = start_run(trainer, plan.sp_size, trainer.nccl_timeout)
    claim_run_directory(trainer, parallel)
    steps_per_epoch = len(train) // data.train_batch_size
    best = BestModel(trainer.best_model)
    watched = trainer.best_model.save or trainer.best_model.early_stopping_patience is not None
    run = open_run(parallel, trainer, plan.model, hf_config, tokenizer, total_steps=total_steps, run_config=plan.run_config, added=inputs.added,
                   states={"best_model": best} if watched else None)
    model, balance = run.model, router_balance(hf_config)
    batches, batches_epoch = [], -1
    history = []  # this run's steps, for the plots
    with lost_ranks_named(run, trainer.nccl_timeout, "trainer.nccl_timeout"):
        for step in range(run.step + 1, total_steps + 1):
            if best.stops:  # resumed from the checkpoint of an early stop
                break
            epoch, index = divmod(step - 1, steps_per_epoch)
            if epoch != batches_epoch:
                batches, batches_epoch = epoch_batches(len(train), data.train_batch_size, trainer.seed, epoch, data.shuffle), epoch
            mine = rank_share([train[i] for i in batches[index]], parallel.dp_rank, parallel.dp_size)
            timer, lr = StepTimer(step), run.scheduler.get_last_lr()[0]
            with profile_step(step == trainer.profile_step, step, trainer.default_local_dir, parallel.rank), timer("update"):
                micro_batches = plan_micro_batches(mine, plan.micro_batching, parallel)
                local = train_step(model, micro_batches, plan, parallel, tokenizer.pad_token_id, balance)
                grad_norm, applied = clipped_step(model, run.optimizer, plan.clip_grad, run.trained_rows)
                run.scheduler.step()
            nll_sum, token_sum, seen, balance_sum = all_reduce_sum([local[0], *once_per_sp_group(local[1:], parallel)], parallel.device)
            elapsed = timer.elapsed()
            metrics = {
                "train/loss": nll_sum / max(token_sum, 1.0),
                "train/grad_norm": grad_norm,
                "train/update_skipped": float(not applied),
                "train/lr": lr,
                "train/epoch": epoch,
                "perf/tokens_per_sec": seen / elapsed,
                "perf/max_memory_gb": max_over_ranks(peak_memory_gb(parallel.device), parallel.device),
                **({"train/moe_load_balancing_loss": balance_sum / data.train_batch_size} if balance else {}),
            }
            if val and run.due(step, trainer.test_freq):
                metrics["val/loss"] = validate(model, val, plan, parallel, tokenizer.pad_token_id)
                if watched and best.observe(step, metrics["val/loss"]) and trainer.best_model.save:
                    run.checkpoints.save_best(step, {"val/loss": best.loss})
                if watched:
                    metrics["val/best_loss"] = best.loss
            run.end_step(step, metrics)
            history.append({"step": step, **metrics})
            last = step == total_steps or best.stops
            if parallel.is_main and (run.due(step, trainer.plot_freq, last_when_off=True) or last):
                run.logger.log_images(write_plots(history, None, os.path.join(trainer.default_local_dir, "plots")), step)
            if best.stops:
                if not run.due(step, trainer.save_freq):
                    run.checkpoints.save(step)
                if parallel.is_main:
                    log.info(f"early stop at step {step}: val/loss has not fallen below {best.loss:.4f} (step {best.step}) by more than "
                             f"{trainer.best_model.early_stopping_threshold} for {best.waited} validations "
                             "(trainer.best_model.early_stopping_patience)")
                break
    run.finish()
