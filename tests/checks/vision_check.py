"""Run under torchrun by test_vision_language.py: one GRPO mini-batch's gradient for a vision-language model, and
one value-loss gradient of its critic (the model with a value head), its groups' prompts with images and without
(read from DATA as the trainer reads them), written by rank 0 to OUT so that layouts (ranks, micro-batch size,
packing, shared prompts, Ulysses) can be compared.

    python -m torch.distributed.run --nproc_per_node=N -m tests.checks.vision_check MODEL_DIR DATA OUT MICRO PACKED SP
"""

import sys

import torch
from hydra import compose, initialize_config_module
from torch.distributed.tensor import DTensor
from transformers import AutoTokenizer

from fsdptrain.config.grpo import load_grpo_config
from fsdptrain.data.images import image_reader
from fsdptrain.distributed.mesh import world_from_environment
from fsdptrain.models.architecture import read_architecture
from fsdptrain.models.loading import load_model_config
from fsdptrain.rl.actor import compute_log_probs, mini_batch_backward
from fsdptrain.rl.critic import value_backward
from fsdptrain.rl.data import load_prompts
from fsdptrain.rl.rollout.base import Generation
from fsdptrain.rl.samples import aligned, make_samples
from fsdptrain.trainer.grpo import build_critic, critic_model_config
from fsdptrain.trainer.grpo_plan import actor_batching, fit_to_architecture, plan_grpo
from fsdptrain.trainer.setup import build_sharded_model, end_run, start_run


def main() -> None:
    model_dir, data, out, micro, packed, sp = sys.argv[1:7]
    layout = [] if micro == "default" else [f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}", "actor_rollout_ref.actor.use_dynamic_bsz=false",
                                            f"critic.ppo_micro_batch_size_per_gpu={micro}", "critic.use_dynamic_bsz=false"]
    with initialize_config_module(config_module="fsdptrain.config", version_base=None):
        config = load_grpo_config(compose(config_name="grpo_trainer", overrides=[
            "data.train_files=unused.parquet", f"actor_rollout_ref.model.path={model_dir}", "trainer.device=cpu", "algorithm.adv_estimator=gae",
            "actor_rollout_ref.model.enable_gradient_checkpointing=false", f"actor_rollout_ref.model.use_remove_padding={packed}", *layout,
            "actor_rollout_ref.model.chunked_loss_tokens=16", f"actor_rollout_ref.actor.ulysses_sequence_parallel_size={sp}", "data.max_response_length=12",
            "actor_rollout_ref.actor.fsdp_config.model_dtype=fp32", "critic.model.enable_gradient_checkpointing=false",
            f"critic.model.use_remove_padding={packed}", "critic.model.fsdp_config.model_dtype=fp32"]))
    parallel = start_run(config.trainer, sp_size=int(sp))
    model_config = config.actor_rollout_ref.model
    hf_config = load_model_config(model_dir, "model", model_config, parallel.sp_size)
    architecture = read_architecture(hf_config)
    plan = fit_to_architecture(plan_grpo(config, world_from_environment("cpu"), pad_id=0), architecture, architecture)
    model = build_sharded_model(model_dir, model_config, config.actor_rollout_ref.actor.fsdp_config, hf_config, config.trainer, parallel,
                                packed == "true", trainable=True)

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = load_prompts([data], tokenizer, images=image_reader(model_dir, "model", "images", tokenizer, hf_config, False))
    g = torch.Generator().manual_seed(0)
    generations = []
    for prompt in prompts:  # four responses to each prompt, the same on every layout
        for _ in range(4):
            response = torch.randint(3, 300, (int(torch.randint(2, 10, (), generator=g)),), generator=g).tolist()
            generations.append(Generation(prompt.ids, response, [1] * len(response), None, False, images=prompt.images))
    everything = make_samples(generations, mask_truncated=False)
    for sample, generation in zip(everything, generations):
        sample.token_values["advantage"] = aligned(torch.full((len(generation.response_ids),), float(torch.randn((), generator=g))),
                                                   len(generation.prompt_ids))
    mine = everything[parallel.dp_rank :: parallel.dp_size]
    compute_log_probs(model, mine, actor_batching(config, 4, "size"), plan.forward, parallel, key="old_log_prob")
    for sample, index in zip(mine, range(parallel.dp_rank, len(everything), parallel.dp_size)):  # ratios on both sides of the clip
        noise = torch.randn(len(sample), generator=torch.Generator().manual_seed(100 + index)) * 0.3
        sample.token_values["old_log_prob"] += noise * sample.loss_mask
    model.zero_grad(set_to_none=True)
    mini_batch_backward(model, mine, plan.update_batching, plan.forward, plan.loss, parallel, first_pass_is_old=False)
    gradient = {"actor": full_gradient(model)}

    critic = build_critic(plan, parallel, total_steps=1, hf_config=critic_model_config(plan.critic_model, len(tokenizer), plan.sp_size))
    for sample, index in zip(everything, range(len(everything))):
        returns = torch.randn(len(sample), generator=torch.Generator().manual_seed(200 + index))
        sample.token_values["returns"] = returns * sample.loss_mask
    critic.values(mine)
    for sample, index in zip(mine, range(parallel.dp_rank, len(everything), parallel.dp_size)):  # old values off the current ones
        noise = torch.randn(len(sample), generator=torch.Generator().manual_seed(300 + index)) * 0.2
        sample.token_values["values"] = sample.token_values["values"] + noise * sample.loss_mask
    critic.model.zero_grad(set_to_none=True)
    value_backward(critic.model, mine, critic.micro_batching, critic.forward, critic.loss, parallel)
    gradient["critic"] = full_gradient(critic.model)
    if parallel.is_main:
        torch.save(gradient, out)
    end_run()


def full_gradient(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone() for name, p in model.named_parameters()}


if __name__ == "__main__":
    main()
