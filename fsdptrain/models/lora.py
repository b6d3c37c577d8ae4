"""LoRA adapters (peft) on a plain Hugging Face model.

The adapters are injected in place (peft's `inject_adapter_in_model`), so the model keeps its class, its forward and
the FSDP groups of its decoder layers: a targeted linear layer `m` becomes a peft layer whose frozen weight is
`m.base_layer.weight` and whose adapters are `m.lora_A.default.weight` and `m.lora_B.default.weight`. Only the
adapters are trained; what leaves the trainer (the rollout engine's weights, the Hugging Face export) is merged
back into the model's own names, W + scaling * B @ A, and peft's adapter format is written on request.
"""

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace

import torch
from safetensors.torch import save_file
from torch import nn
from transformers import PretrainedConfig

from fsdptrain.config.shared import LoRASettings
from fsdptrain.distributed.fsdp import decoder_layers, full_parameters
from fsdptrain.errors import ConfigError
from fsdptrain.models.vision import VISION_TOWER_MODULES, is_vision_language

ADAPTER = "default"  # peft's adapter name: the one adapter a model trains here
BASE, LORA_A, LORA_B = ".base_layer.", f".lora_A.{ADAPTER}.weight", f".lora_B.{ADAPTER}.weight"


def peft_config(lora: LoRASettings, base_model: str | None = None):
    from peft import LoraConfig  # imported by the runs that train adapters alone: it is slow to import

    return LoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=lora.target_modules, exclude_modules=lora.exclude_modules,
                      lora_dropout=lora.dropout, base_model_name_or_path=base_model, task_type="CAUSAL_LM")


def for_model(lora: LoRASettings | None, hf_config: PretrainedConfig) -> LoRASettings | None:
    """`lora` as it applies to a model of `hf_config`: on a vision-language model, target_modules="all-linear"
    without exclude_modules adapts the language decoder and leaves the vision tower as loaded (its merger is in no
    sharded layer, where adapters live; the tower's modules can be named in target_modules)."""
    if lora is None or not is_vision_language(hf_config) or lora.target_modules != "all-linear" or lora.exclude_modules is not None:
        return lora
    return replace(lora, exclude_modules=VISION_TOWER_MODULES)


def linear_module_names(model: nn.Module) -> list[str]:
    """The distinct last names of the model's linear layers: what target_modules can name."""
    return sorted({name.rpartition(".")[2] for name, module in model.named_modules() if isinstance(module, nn.Linear)})


def add_adapters(model: nn.Module, lora: LoRASettings, seed: int) -> None:
    """Inject the adapters in place, in fp32, and freeze everything else. Adapters are initialized by peft (A random,
    B zero, so the model starts as the pretrained one) after torch.manual_seed(`seed`), leaving the global generator
    as it was."""
    key = lora.key
    linear = linear_module_names(model)
    from peft import inject_adapter_in_model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            inject_adapter_in_model(peft_config(lora), model, adapter_name=ADAPTER)
        except ValueError as e:
            raise ConfigError(f"{key}.target_modules={lora.target_modules!r} (exclude_modules={lora.exclude_modules!r}): "
                              f"{str(e).splitlines()[0]} The model's linear layers: {', '.join(linear)}") from None
    for _, module in lora_layers(model):
        module.lora_A.to(torch.float32)
        module.lora_B.to(torch.float32)
    in_layers = {id(m) for layer in decoder_layers(model) for m in layer.modules()}
    outside = [name for name, module in lora_layers(model) if id(module) not in in_layers]
    if outside:
        raise ConfigError(f"{key}.target_modules: adapters go on the decoder layers' linear layers, not on {outside} (the output layer "
                          f"and the embeddings are read directly by the loss); the model's linear layers: {', '.join(linear)}")
    for name, param in model.named_parameters():
        param.requires_grad_(LORA_A in name or LORA_B in name)


def lora_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's adapted layers (name, peft's layer); none where peft was never imported, as only add_adapters
    makes them."""
    if "peft" not in sys.modules:
        return []
    from peft.tuners.lora import LoraLayer

    return [(name, module) for name, module in model.named_modules() if isinstance(module, LoraLayer)]


def has_adapters(model: nn.Module) -> bool:
    return bool(lora_layers(model))


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """The pretrained model, for the reference log-probs: every adapter off until the block ends (a model without
    adapters is left as it is)."""
    layers = [module for _, module in lora_layers(model)]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def merged_weights(model: nn.Module, dtype: torch.dtype | None = None, bucket_bytes: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) of the model's weights under the Hugging Face model's own names, in `dtype`: the sharded
    parameters gathered `bucket_bytes` at a time (distributed/fsdp.full_parameters; every rank must iterate), each
    adapted layer's weight merged in fp32 as W + scaling * B @ A once its three parts have arrived."""
    scaling = {name: module.scaling[ADAPTER] for name, module in lora_layers(model)}
    if not scaling:
        yield from full_parameters(model, dtype, bucket_bytes)
        return
    cast: Callable[[torch.Tensor], torch.Tensor] = (lambda t: t) if dtype is None else (lambda t: t.to(dtype))
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in full_parameters(model, None, bucket_bytes):
        if BASE in name:
            layer, _, leaf = name.partition(BASE)
            if leaf != "weight":
                yield f"{layer}.{leaf}", cast(tensor)
                continue
            part = "W"
        elif name.endswith(LORA_A) or name.endswith(LORA_B):
            layer, part = name[: -len(LORA_A)], "A" if name.endswith(LORA_A) else "B"
        else:
            yield name, cast(tensor)
            continue
        pieces = parts.setdefault(layer, {})
        pieces[part] = tensor
        if len(pieces) == 3:
            del parts[layer]
            merged = pieces["W"].float() + scaling[layer] * (pieces["B"].float() @ pieces["A"].float())
            yield f"{layer}.weight", merged.to(dtype or pieces["W"].dtype)


def adapter_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full adapter tensors under peft's saved names (base_model.model.<module>.lora_A.weight), gathered on every
    rank (a collective)."""
    adapters = {}
    for name, tensor in full_parameters(model, keep=lambda n: LORA_A in n or LORA_B in n):
        adapters["base_model.model." + name.replace(f".{ADAPTER}.", ".")] = tensor.detach().cpu().contiguous()
    return adapters


def save_adapter(out: str, adapters: dict[str, torch.Tensor], lora: LoRASettings, base_model: str) -> None:
    """peft's adapter folder (adapter_config.json, adapter_model.safetensors): what `PeftModel.from_pretrained(base,
    out)` loads."""
    os.makedirs(out, exist_ok=True)
    peft_config(lora, base_model).save_pretrained(out)
    save_file(adapters, os.path.join(out, "adapter_model.safetensors"), metadata={"format": "pt"})
