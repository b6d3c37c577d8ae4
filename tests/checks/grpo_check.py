"""Run under torchrun by test_grpo.py: one GRPO mini-batch's gradient, for every loss mode and aggregation mode and
for on-policy distillation's losses (a teacher's top-k carried as (length, k) token values), written by rank 0 to OUT so that layouts (ranks, micro-batch size, packing) can be compared; and the old
log-probs that the one-pass update keeps, checked here against a separate pass.

    python -m torch.distributed.run --nproc_per_node=N -m tests.checks.grpo_check MODEL_DIR OUT MICRO PACKED SP [balance]

MICRO is sequences per micro-batch, or `default` for the defaults (packed rows filled to a token budget); SP the
Ulysses group size. With `balance` (an MoE model whose config asks for its routers' load-balancing loss), only the
default loss's gradient, that loss included, is written.
"""

import itertools
import sys

import torch
from hydra import compose, initialize_config_module
from torch.distributed.tensor import DTensor

from fsdptrain.config.grpo import load_grpo_config
from fsdptrain.distributed.mesh import world_from_environment
from fsdptrain.models.architecture import read_architecture
from fsdptrain.models.loading import load_model_config
from fsdptrain.rl.actor import compute_log_probs, has_advantage, mini_batch_backward
from fsdptrain.rl.balance import deal_groups
from fsdptrain.rl.core_algos import LOSS_AGG_MODES, POLICY_LOSSES
from fsdptrain.rl.distillation import TEACHER_LOG_PROB, TEACHER_TOPK_IDS, TEACHER_TOPK_LOG_PROBS
from fsdptrain.trainer.grpo_plan import actor_batching, fit_to_architecture, plan_grpo
from fsdptrain.trainer.setup import build_sharded_model, end_run, start_run
from tests.checks.common import relative_gap, two_groups


def main() -> None:
    model_dir, out, micro, packed, sp = sys.argv[1:6]


    LAYOUT = [] if micro == "default" else [f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}", "actor_rollout_ref.actor.use_dynamic_bsz=false"]


    def config(*overrides):
        with initialize_config_module(config_module="fsdptrain.config", version_base=None):
            return load_grpo_config(compose(config_name="grpo_trainer", overrides=[
                "data.train_files=unused.parquet", f"actor_rollout_ref.model.path={model_dir}", "trainer.device=cpu",
                "actor_rollout_ref.model.enable_gradient_checkpointing=false", f"actor_rollout_ref.model.use_remove_padding={packed}",
                *LAYOUT, f"actor_rollout_ref.actor.ulysses_sequence_parallel_size={sp}", "actor_rollout_ref.model.chunked_loss_tokens=16",
                "data.max_response_length=12", "actor_rollout_ref.actor.policy_loss.dro_beta=0.1", *overrides]))


    base = config()
    parallel = start_run(base.trainer, sp_size=int(sp))
    hf_config = load_model_config(model_dir, "model", base.actor_rollout_ref.model, parallel.sp_size)

    def plan(*overrides):  # as the trainer plans it for this model
        return fit_to_architecture(plan_grpo(config(*overrides), world_from_environment("cpu"), pad_id=0), read_architecture(hf_config))

    base_plan = plan()
    model = build_sharded_model(model_dir, base.actor_rollout_ref.model, base.actor_rollout_ref.actor.fsdp_config, hf_config, base.trainer,
                                parallel, packed == "true", trainable=True)

    # Each rank holds every dp-th sequence, so a rank's packed rows share each prompt between the responses they
    # hold of it (not padded rows, not under SP).
    everything = two_groups(lambda g, prompt, response, mask: {
        "advantage": torch.cat([torch.zeros(prompt), torch.full((response,), float(torch.randn((), generator=g)))]),
        "sft": torch.cat([torch.zeros(prompt), torch.full((response,), float(torch.rand((), generator=g) > 0.5))])})
    mine = everything[parallel.dp_rank :: parallel.dp_size]
    compute_log_probs(model, mine, actor_batching(base, 4, "size"), base_plan.forward, parallel, key="old_log_prob")
    separate_pass = [sample.token_values["old_log_prob"].clone() for sample in mine]
    for sample, index in zip(mine, range(parallel.dp_rank, 8, parallel.dp_size)):
        noise = torch.randn(len(sample), generator=torch.Generator().manual_seed(100 + index)) * 0.3  # ratios on both sides of the clip
        sample.token_values["old_log_prob"] += noise * sample.loss_mask

    def gradient(*overrides):
        """The whole gradient of one mini-batch of `mine` under the config with `overrides`."""
        variant = plan(*overrides)
        model.zero_grad(set_to_none=True)
        mini_batch_backward(model, mine, variant.update_batching, variant.forward, variant.loss, parallel,
                            first_pass_is_old=False)
        return {name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone() for name, p in model.named_parameters()}

    if sys.argv[6:] == ["balance"]:
        assert base_plan.loss.router_balance is not None and not base_plan.forward.share_prompts
        balanced = gradient()
        if parallel.is_main:
            torch.save({"vanilla token-mean balance": balanced}, out)
        end_run()
        return
    gradients = {
        f"{loss_mode} {agg_mode}": gradient(f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode}",
                                            f"actor_rollout_ref.actor.loss_agg_mode={agg_mode}", "actor_rollout_ref.actor.entropy_coeff=0.01")
        for loss_mode, agg_mode in itertools.product(POLICY_LOSSES, LOSS_AGG_MODES)
        # every aggregation with the default loss, two with the others (the aggregation follows the loss); a loss
        # that reads its micro-batch's statistics depends on the split; one with its own aggregation, once
        if not POLICY_LOSSES.info[loss_mode].batch_local
        and (agg_mode == POLICY_LOSSES.info[loss_mode].agg_mode if POLICY_LOSSES.info[loss_mode].agg_mode
             else loss_mode == "vanilla" or agg_mode in ("token-mean", "seq-mean-token-mean"))
    }
    # the SFT term on the responses marked correct (token values `sft`), over their global token count
    gradients["vanilla token-mean sft"] = gradient("actor_rollout_ref.actor.sft_loss_coef=0.5")

    # On-policy distillation from a teacher's token values drawn here (its top-k: (length, k) values through the
    # packing, the padding and the Ulysses slices): the top-k forward KL and k3 alone, k1 as the policy gradient's
    # reward, and k3 beside the task's loss, which is the sum of the two
    for sample, index in zip(mine, range(parallel.dp_rank, 8, parallel.dp_size)):
        g = torch.Generator().manual_seed(200 + index)
        sample.token_values[TEACHER_LOG_PROB] = -torch.rand(len(sample), generator=g) * 6
        sample.token_values[TEACHER_TOPK_IDS] = torch.randint(3, 1000, (len(sample), 4), generator=g)
        sample.token_values[TEACHER_TOPK_LOG_PROBS] = torch.randn(len(sample), 1000, generator=g).log_softmax(-1)[:, :4] + 2.0
    teacher = ("distillation.enabled=true", f"distillation.teacher_models.teacher_model.model_path={model_dir}",
               "distillation.distillation_loss.topk=4")
    alone = "distillation.distillation_loss.use_task_rewards=false"
    gradients["distillation forward_kl_topk"] = gradient(*teacher, alone, "distillation.distillation_loss.loss_mode=forward_kl_topk",
                                                         "distillation.distillation_loss.log_prob_min_clamp=-9")
    gradients["distillation k1 policy gradient"] = gradient(*teacher, alone, "distillation.distillation_loss.loss_mode=k1",
                                                            "distillation.distillation_loss.use_policy_gradient=true",
                                                            "distillation.distillation_loss.loss_max_clamp=2")
    distillation_alone = gradient(*teacher, alone, "distillation.distillation_loss.loss_mode=k3")
    gradients["distillation k3 with the task's loss"] = gradient(*teacher, "distillation.distillation_loss.loss_mode=k3",
                                                                 "distillation.distillation_loss.distillation_loss_coef=0.5")
    task_alone = gradient()
    combined = {name: task_alone[name] + 0.5 * distillation_alone[name] for name in task_alone}
    assert relative_gap(gradients["distillation k3 with the task's loss"], combined) < 1e-5

    # Samples without advantage skipped (skip_zero_advantage): the same gradient. The odd sequences have none, so
    # that under dp 2 one rank forwards nothing of its own; with none left anywhere, the gradients are zeros.
    advantages = [sample.token_values["advantage"].clone() for sample in mine]
    for sample, index in zip(mine, range(parallel.dp_rank, 8, parallel.dp_size)):
        sample.token_values["advantage"] *= index % 2 == 0
    for loss_mode, agg_mode in (("vanilla", "token-mean"), ("gspo", "seq-mean-token-mean")):
        modes = (f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode}", f"actor_rollout_ref.actor.loss_agg_mode={agg_mode}")
        every = gradient(*modes)
        skipped = gradient(*modes, "actor_rollout_ref.actor.skip_zero_advantage=true")
        assert relative_gap(skipped, every) < 5e-6, (loss_mode, relative_gap(skipped, every))
    # The groups kept are dealt out again over the ranks by their tokens: every kept sample once, each rank a run
    # (under dp 2 the one rank's two half-groups, one each)
    kept = [sample for sample in mine if has_advantage(sample)]
    dealt = deal_groups(kept, parallel, share_prompts=True)
    everyone = [None] * parallel.dp_size
    torch.distributed.all_gather_object(everyone, dealt.origins, group=parallel.dp_group)
    kept_counts = [sum(index % 2 == 0 for index in range(rank, 8, parallel.dp_size)) for rank in range(parallel.dp_size)]
    assert sorted(o for origins in everyone for o in origins) == [(rank, i) for rank in range(parallel.dp_size) for i in range(kept_counts[rank])]
    assert all(everyone), everyone
    for sample in mine:
        sample.token_values["advantage"].zero_()
    assert all(float(grad.abs().max()) == 0 for grad in gradient("actor_rollout_ref.actor.skip_zero_advantage=true").values())
    for sample, advantage in zip(mine, advantages):
        sample.token_values["advantage"] = advantage

    # One mini-batch, one epoch: the update's own forward is the old policy, and it keeps those log-probs for the
    # engine's agreement metrics (Ulysses slices joined); they are the separate pass's, whatever the layout.
    for sample in mine:
        sample.token_values["rollout_log_prob"] = torch.zeros(len(sample))
        del sample.token_values["old_log_prob"]
    mini_batch_backward(model, mine, base_plan.update_batching, base_plan.forward, base_plan.loss, parallel, first_pass_is_old=True)
    for sample, log_probs in zip(mine, separate_pass):
        torch.testing.assert_close(sample.token_values["old_log_prob"], log_probs, atol=1e-5, rtol=0)
    # One mini-batch, one epoch, skipping: the old log-probs the update's forward keeps are set on the samples
    # it forwarded, wherever they were trained
    for sample, index in zip(mine, range(parallel.dp_rank, 8, parallel.dp_size)):
        sample.token_values["advantage"] *= index % 2 == 0
        del sample.token_values["old_log_prob"]
    skipping = plan("actor_rollout_ref.actor.skip_zero_advantage=true")
    mini_batch_backward(model, mine, skipping.update_batching, skipping.forward, skipping.loss, parallel, first_pass_is_old=True)
    for sample, log_probs in zip(mine, separate_pass):
        if has_advantage(sample):
            torch.testing.assert_close(sample.token_values.pop("old_log_prob"), log_probs, atol=1e-5, rtol=0)
        else:
            assert "old_log_prob" not in sample.token_values
    if parallel.is_main:
        torch.save(gradients, out)
    end_run()
    print("ok", parallel.rank)


if __name__ == "__main__":
    main()
