"""Run under torchrun by test_lora.py: a LoRA policy on the shared engine. Only its adapters train (fp32, the only
parameters in the optimizer; the frozen weights in the compute dtype); after a step, its log-probs with the adapters switched off equal those of the base
model loaded separately (the GRPO reference), while with them on they differ; and the merged weights it sends to a
rollout engine, loaded into a plain transformers model, give the logits of peft's own model holding the adapters
it exports.

    python -m torch.distributed.run --standalone --nproc_per_node=2 -m tests.checks.lora_check MODEL_DIR
"""

import sys

import torch
from hydra import compose, initialize_config_module
from peft import get_peft_model, set_peft_model_state_dict
from transformers import AutoConfig, AutoModelForCausalLM

from fsdptrain.config.sft import load_sft_config
from fsdptrain.data.dataset import Sample
from fsdptrain.data.micro_batches import MicroBatching, collate, plan_micro_batches
from fsdptrain.models.lora import adapter_weights, adapters_disabled, merged_weights, peft_config
from fsdptrain.models.loss import token_log_probs
from fsdptrain.optim import build_optimizer, clipped_step
from fsdptrain.trainer.setup import build_sharded_model, end_run, start_run


def main() -> None:
    model_dir = sys.argv[1]
    with initialize_config_module(config_module="fsdptrain.config", version_base=None):
        config = load_sft_config(compose(config_name="sft_trainer", overrides=[
            "data.train_files=unused.parquet", f"model.partial_pretrain={model_dir}", "trainer.device=cpu", "model.lora_rank=4",
            "model.lora_alpha=8", "model.target_modules=[q_proj,v_proj,down_proj]", "optim.lr=0.05",
        ]))
    lora = config.model.lora("model")
    parallel = start_run(config.trainer, sp_size=1)
    hf_config = AutoConfig.from_pretrained(model_dir)
    fsdp = config.model.fsdp_config
    policy = build_sharded_model(model_dir, config.model, fsdp, hf_config, config.trainer, parallel, packed=True, trainable=True, lora=lora)
    base = build_sharded_model(model_dir, config.model, fsdp, hf_config, config.trainer, parallel, packed=True, trainable=False)
    trained = {name for name, p in policy.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A.default." in n or ".lora_B.default." in n for n in trained), trained
    assert all(p.dtype == torch.float32 for p in policy.parameters() if p.requires_grad)
    assert len(trained) == 2 * 3 * hf_config.num_hidden_layers  # A and B on three modules of every layer
    half_fsdp = type(fsdp)(**{**vars(fsdp), "mixed_precision": type(fsdp.mixed_precision)("bf16", "fp32")})
    half = build_sharded_model(model_dir, config.model, half_fsdp, hf_config, config.trainer, parallel, packed=True, trainable=True, lora=lora)
    assert {p.dtype for p in half.parameters() if p.requires_grad} == {torch.float32}  # the frozen weights in the compute dtype
    assert {p.dtype for p in half.parameters() if not p.requires_grad} == {torch.bfloat16}
    del half
    optimizer = build_optimizer(policy, config.optim)
    assert sum(len(group["params"]) for group in optimizer.param_groups) == len(trained)

    g = torch.Generator().manual_seed(parallel.rank)
    samples = []
    for n in (9, 17, 30, 12):
        mask = torch.zeros(n, dtype=torch.long)
        mask[n // 2 :] = 1
        samples.append(Sample(torch.randint(3, 1000, (n,), generator=g), mask, {"advantage": torch.randn(n, generator=g)}))
    micro_batches = plan_micro_batches(samples, MicroBatching(2, False, None, "size", "dynamic", "max_tokens"), parallel)
    for micro_batch in micro_batches:  # one step: B leaves zero, so the adapters change the model
        batch = collate(micro_batch, packed=True, pad_token_id=0, parallel=parallel)
        log_probs, _ = token_log_probs(policy, batch.inputs, batch.targets["labels"], 1.0, chunk_tokens=8)
        (-(log_probs * batch.targets["advantage"]).sum()).backward()
    clipped_step(policy, optimizer, 1.0)

    for micro_batch in micro_batches:
        batch = collate(micro_batch, packed=True, pad_token_id=0, parallel=parallel)
        with torch.no_grad():
            separate, _ = token_log_probs(base, batch.inputs, batch.targets["labels"], 1.0, chunk_tokens=8)
            adapted, _ = token_log_probs(policy, batch.inputs, batch.targets["labels"], 1.0, chunk_tokens=8)
            with adapters_disabled(policy):
                switched_off, _ = token_log_probs(policy, batch.inputs, batch.targets["labels"], 1.0, chunk_tokens=8)
        torch.testing.assert_close(switched_off, separate, rtol=1e-6, atol=1e-6)
        assert (adapted - separate).abs().max() > 1e-3, "the trained adapters do not change the log-probs"
        adapted_again, _ = token_log_probs(policy, batch.inputs, batch.targets["labels"], 1.0, chunk_tokens=8)
        assert torch.equal(adapted_again.detach(), adapted), "the adapters did not come back on"

    merged = dict(merged_weights(policy, bucket_bytes=50_000))
    adapters = adapter_weights(policy)
    if parallel.is_main:
        plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        assert merged.keys() == dict(plain.named_parameters()).keys()
        pretrained = plain.model.layers[0].self_attn.q_proj.weight.detach().clone()
        plain.load_state_dict(merged, strict=False)
        assert not torch.equal(plain.model.layers[0].self_attn.q_proj.weight, pretrained), "the adapters were not merged"
        reference = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), peft_config(lora))
        loaded = set_peft_model_state_dict(reference, adapters)
        assert not loaded.unexpected_keys, loaded.unexpected_keys
        ids = torch.randint(3, 1000, (2, 21), generator=g)
        with torch.no_grad():
            torch.testing.assert_close(plain(ids).logits, reference(ids).logits, rtol=1e-5, atol=1e-5)
    end_run()
    print("ok", parallel.rank)


if __name__ == "__main__":
    main()
