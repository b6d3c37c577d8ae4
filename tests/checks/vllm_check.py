"""Run under torchrun by test_vllm.py: the vLLM engine of each rank against the FSDP actor it samples for.

    python -m torch.distributed.run --nproc_per_node=2 -m tests.checks.vllm_check MODEL_DIR

1. Before any sync the engine holds random weights (load_format=dummy); after the first, its sampling log-probs
   (temperature 0.8) equal the trainer's log-probs of the same tokens.
2. The actor's weights move; the trainer's log-probs of those responses change, and after a sync the engine's
   log-probs of the same fixed responses (prompt log-probs, temperature 1) equal the trainer's again.
"""

import sys

import torch
from hydra import compose, initialize_config_module

from fsdptrain.config.grpo import load_grpo_config
from fsdptrain.distributed.mesh import world_from_environment
from fsdptrain.models.loading import load_model_config
from fsdptrain.rl.actor import compute_log_probs
from fsdptrain.rl.rollout import build_rollout, sync_weights
from fsdptrain.rl.samples import make_samples
from fsdptrain.trainer.grpo_plan import actor_batching, plan_grpo
from fsdptrain.trainer.setup import build_sharded_model, end_run, start_run


def main() -> None:
    TOLERANCE = 1e-4  # fp32 on both sides; measured about 5e-6

    model_dir = sys.argv[1]


    def config(temperature: float):
        with initialize_config_module(config_module="fsdptrain.config", version_base=None):
            return load_grpo_config(compose(config_name="grpo_trainer", overrides=[
                "data.train_files=unused.parquet", f"actor_rollout_ref.model.path={model_dir}", "trainer.device=cpu",
                "actor_rollout_ref.model.enable_gradient_checkpointing=false", "data.max_prompt_length=16", "data.max_response_length=12",
                "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.gpu_memory_utilization=0.1",
                f"actor_rollout_ref.rollout.temperature={temperature}"]))


    def worst(samples, key_a, key_b):
        return max(float(((s.token_values[key_a] - s.token_values[key_b]) * s.loss_mask).abs().max()) for s in samples)


    sampling, scoring = config(0.8), config(1.0)
    sampling_plan, scoring_plan = (plan_grpo(c, world_from_environment("cpu"), pad_id=2) for c in (sampling, scoring))
    parallel = start_run(sampling.trainer, sp_size=1)
    hf_config = load_model_config(model_dir, "model", sampling.actor_rollout_ref.model, 1)
    model = build_sharded_model(model_dir, sampling.actor_rollout_ref.model, sampling.actor_rollout_ref.actor.fsdp_config, hf_config,
                                sampling.trainer, parallel, packed=True, trainable=True)
    engine = build_rollout(sampling_plan.engine_name, sampling_plan.engine)
    bucket_bytes = sampling_plan.weight_bucket_bytes
    batching = actor_batching(sampling, 4, "size")
    prompts = [[1, 5 + parallel.rank, 17, 42], [1, 7, 8]]

    untrained = engine.generate(prompts, n=2, max_new_tokens=12, batch_size=4, temperature=0.8, calculate_log_probs=True)
    samples = make_samples(untrained, mask_truncated=False)
    compute_log_probs(model, samples, batching, sampling_plan.forward, parallel, key="old_log_prob")
    assert worst(samples, "old_log_prob", "rollout_log_prob") > 0.1, "the dummy-loaded engine already samples like the actor"

    sync_weights(model, engine, bucket_bytes)
    generations = engine.generate(prompts, n=2, max_new_tokens=12, batch_size=4, temperature=0.8, calculate_log_probs=True)
    samples = make_samples(generations, mask_truncated=False)
    compute_log_probs(model, samples, batching, sampling_plan.forward, parallel, key="old_log_prob")
    assert worst(samples, "old_log_prob", "rollout_log_prob") < TOLERANCE, worst(samples, "old_log_prob", "rollout_log_prob")


    def engine_log_probs(samples) -> None:
        """The engine's log-probs (temperature 1) of each sample's own tokens, as its token values `engine`."""
        params = engine._sampling_params(max_tokens=1, prompt_logprobs=0, temperature=1.0)
        outputs = engine.llm.generate([{"prompt_token_ids": s.input_ids.tolist()} for s in samples], params, use_tqdm=False)
        for sample, output in zip(samples, outputs):
            ids = sample.input_ids.tolist()
            values = [0.0] + [float(step[token].logprob) for step, token in zip(output.prompt_logprobs[1:], ids[1:])]
            sample.token_values["engine"] = torch.tensor(values)


    compute_log_probs(model, samples, batching, scoring_plan.forward, parallel, key="before")
    engine_log_probs(samples)
    assert worst(samples, "before", "engine") < TOLERANCE
    with torch.no_grad():
        generator = torch.Generator().manual_seed(1)
        for parameter in model.parameters():  # a large update: every shard moves
            local = parameter.to_local()
            local.add_(0.05 * torch.randn(local.shape, generator=generator))
    compute_log_probs(model, samples, batching, scoring_plan.forward, parallel, key="after")
    assert worst(samples, "before", "after") > 0.1, "the update did not change the policy"
    assert worst(samples, "engine", "after") > 0.1, "the engine follows the actor without a sync"
    sync_weights(model, engine, bucket_bytes)
    engine_log_probs(samples)
    assert worst(samples, "after", "engine") < TOLERANCE, worst(samples, "after", "engine")
    print("ok", parallel.rank, worst(samples, "after", "engine"))
    end_run(engine.shutdown)


if __name__ == "__main__":
    main()
