"""Run under torchrun by test_engine.py: the pieces a second trainer (GRPO) builds on, used the way it will use
them. A trained and a frozen (offloaded) copy of one model from the shared set-up; per-token log-probs with a
different gradient at every token, through micro-batches whose loss inputs travel beside the model inputs; one
clipped optimizer step; and every full parameter gathered from the shards, one at a time or in buckets (also of
parameters whose rows do not split evenly over the ranks).

    python -m torch.distributed.run --standalone --nproc_per_node=2 -m tests.checks.engine_check MODEL_DIR
"""

import sys

import torch
from hydra import compose, initialize_config_module
from safetensors.torch import load_file
from torch.distributed.fsdp import fully_shard
from transformers import AutoConfig

from fsdptrain.config.sft import load_sft_config
from fsdptrain.data.dataset import Sample
from fsdptrain.data.micro_batches import MicroBatching, collate, plan_micro_batches
from fsdptrain.distributed.fsdp import full_parameters
from fsdptrain.dtypes import DTYPES
from fsdptrain.models.loss import token_log_probs
from fsdptrain.optim import build_optimizer, clipped_step
from fsdptrain.trainer.setup import build_sharded_model, end_run, start_run


def main() -> None:
    model_dir = sys.argv[1]
    with initialize_config_module(config_module="fsdptrain.config", version_base=None):
        config = load_sft_config(compose(config_name="sft_trainer", overrides=[
            "data.train_files=unused.parquet", f"model.partial_pretrain={model_dir}", "trainer.device=cpu",
            "model.enable_gradient_checkpointing=false",
        ]))
    parallel = start_run(config.trainer, sp_size=1)
    hf_config = AutoConfig.from_pretrained(model_dir)
    fsdp = config.model.fsdp_config
    actor = build_sharded_model(model_dir, config.model, fsdp, hf_config, config.trainer, parallel, packed=True, trainable=True)
    frozen_fsdp = type(fsdp)(**{**vars(fsdp), "cpu_offload": True})
    reference = build_sharded_model(model_dir, config.model, frozen_fsdp, hf_config, config.trainer, parallel, packed=True, trainable=False)
    assert not any(p.requires_grad for p in reference.parameters()) and not reference.training

    g = torch.Generator().manual_seed(parallel.rank)
    samples = []
    for n in (9, 17, 30, 12):
        mask = torch.zeros(n, dtype=torch.long)
        mask[n // 2 :] = 1  # a prompt, then a response
        samples.append(Sample(torch.randint(3, 1000, (n,), generator=g), mask, {"advantage": torch.randn(n, generator=g)}))
    batching = MicroBatching(2, False, None, "size", "dynamic", "max_tokens")
    optimizer = build_optimizer(actor, config.optim)
    for micro_batch in plan_micro_batches(samples, batching, parallel):
        batch = collate(micro_batch, packed=True, pad_token_id=0, parallel=parallel)
        with torch.no_grad():
            ref_log_probs, _ = token_log_probs(reference, batch.inputs, batch.targets["labels"], 0.7, chunk_tokens=8)
        log_probs, entropy = token_log_probs(actor, batch.inputs, batch.targets["labels"], 0.7, chunk_tokens=8, with_entropy=True)
        torch.testing.assert_close(log_probs.detach(), ref_log_probs, rtol=1e-6, atol=1e-6)  # the same weights, frozen or not
        (-(log_probs * batch.targets["advantage"]).sum() - 0.01 * entropy.sum()).backward()
    grad_norm, applied = clipped_step(actor, optimizer, 1.0)
    assert applied and grad_norm > 0

    on_disk = load_file(f"{model_dir}/model.safetensors")
    for bucket_bytes in (0, 50_000, 2**30):  # a parameter a collective, a few parameters, the whole model
        names = []
        for name, tensor in full_parameters(reference, DTYPES["bf16"], bucket_bytes):
            names.append(name)
            assert tensor.dtype == torch.bfloat16 and tensor.shape == on_disk[name].shape, name
            torch.testing.assert_close(tensor, on_disk[name].to(torch.bfloat16), rtol=0, atol=0)
        assert sorted(names) == sorted(n for n, _ in reference.named_parameters())
    changed = [name for name, tensor in full_parameters(actor, bucket_bytes=2**30) if not torch.equal(tensor, on_disk[name])]
    assert changed, "the optimizer step changed no weight"

    torch.manual_seed(0)
    uneven = torch.nn.Sequential(torch.nn.Linear(4, 7), torch.nn.Linear(7, 3), torch.nn.Linear(3, 1))  # 7, 3, 1 rows over 2 ranks
    whole = {name: p.detach().clone() for name, p in uneven.named_parameters()}
    fully_shard(uneven, mesh=parallel.fsdp_mesh)
    for bucket_bytes in (0, 40, 2**20):
        gathered = dict(full_parameters(uneven, bucket_bytes=bucket_bytes))
        assert gathered.keys() == whole.keys()
        for name, tensor in whole.items():
            assert torch.equal(gathered[name], tensor), (bucket_bytes, name)
    end_run()
    print("ok", parallel.rank)


if __name__ == "__main__":
    main()
