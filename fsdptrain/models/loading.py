"""Build a sharded causal LM from a Hugging Face folder.

Every rank builds the model on the meta device and shards it; only rank 0 reads the weights (on CPU),
and `set_model_state_dict` streams them to the shards, so no rank holds a full copy on the accelerator.
Buffers that are not in the state dict (rotary `inv_freq`) are broadcast from rank 0 as well, because
materializing a meta model leaves them uninitialized.
"""

import copy
import logging
import os
from functools import partial
from types import MethodType

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedTokenizerBase,
)

from fsdptrain.config.shared import FSDPConfig, LanguageModelConfig, LoRASettings, ModelConfig
from fsdptrain.distributed.fsdp import apply_fsdp, embeddings_tied
from fsdptrain.distributed.mesh import Parallel
from fsdptrain.distributed.offload import offload_activations
from fsdptrain.dtypes import DTYPES, compute_dtype
from fsdptrain.errors import ConfigError
from fsdptrain.models.added_tokens import AddedTokens, freeze_all_but_token_matrices, grow_embeddings
from fsdptrain.models.architecture import Architecture, keep_sequences_apart, padded_attention, read_architecture
from fsdptrain.models.attention import PACKED_ATTENTION
from fsdptrain.models.lora import add_adapters
from fsdptrain.models.vision import (
    attention_setting,
    check_supported,
    is_vision_language,
    keep_share_of_row,
    model_class,
    run_tower_on_every_forward,
    vision_tower,
)

log = logging.getLogger("fsdptrain")


def load_model_config(path: str, path_key: str, config: ModelConfig, sp_size: int) -> PretrainedConfig:
    """The folder's model config, checked against the parallel layout before anything heavy is loaded."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"{path_key}={path!r} is not a Hugging Face model folder (no config.json)")
    hf_config = AutoConfig.from_pretrained(path, trust_remote_code=config.trust_remote_code)
    check_supported(hf_config, path_key, path)
    if getattr(config, "freeze_vision_tower", False) and not is_vision_language(hf_config):
        raise ConfigError(f"freeze_vision_tower=true, but {path_key}={path!r} ({hf_config.model_type}) has no vision tower")
    if hf_config.get_text_config().num_attention_heads % sp_size:
        raise ConfigError(
            f"ulysses_sequence_parallel_size ({sp_size}) must divide the model's num_attention_heads "
            f"({hf_config.get_text_config().num_attention_heads})"
        )
    return hf_config


def load_tokenizer(path: str, path_key: str, config: ModelConfig) -> PreTrainedTokenizerBase:
    if not any(os.path.isfile(os.path.join(path, name)) for name in ("tokenizer.json", "tokenizer_config.json")):
        raise ConfigError(f"{path_key}={path!r} is not a Hugging Face model folder with its tokenizer (no tokenizer.json or "
                          "tokenizer_config.json)")
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=config.trust_remote_code)
    if not tokenizer.is_fast:
        raise ConfigError(f"{path_key}={path!r}: a fast tokenizer is required")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def attention_implementation(config: ModelConfig, packed: bool, architecture: Architecture) -> str:
    return PACKED_ATTENTION if packed else padded_attention(architecture, config.attn_implementation)


def _add_rows_to_weight_grad(embedding: nn.Embedding, weight: nn.Parameter, input_ids: torch.Tensor, grad: torch.Tensor) -> None:
    ids = input_ids.flatten()
    rows = grad.reshape(ids.numel(), -1)
    if embedding.padding_idx is not None:
        kept = ids != embedding.padding_idx
        ids, rows = ids[kept], rows[kept]
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    weight.grad.index_add_(0, ids, rows)


def _embed_rows_into_weight_grad(embedding: nn.Embedding, input_ids: torch.Tensor) -> torch.Tensor:
    weight = embedding.weight
    hidden = F.embedding(input_ids, weight.detach(), embedding.padding_idx)
    if torch.is_grad_enabled() and weight.requires_grad:
        hidden.requires_grad_()
        hidden.register_hook(partial(_add_rows_to_weight_grad, embedding, weight, input_ids))
    return hidden


def tied_embedding_grad_in_place(model: nn.Module) -> bool:
    """Where the input embedding shares its weight with the output layer, let it add its gradient rows into the
    weight's gradient in place.

    The tied weight's gradient is the output layer's dense one plus the embedding's rows. Through autograd, the
    rows come as a (vocab x hidden) dense buffer (zero-filled) or, as sparse rows, are summed out of place: either
    way a fresh full-size buffer per backward, which on CPU is a page-faulting pass. Here the lookup reads a
    detached weight and a hook on its output adds the rows into `weight.grad` (the output layer's gradient is
    already there: autograd runs a leaf's accumulation as soon as it is ready, and adds into it in any order).
    Returns whether the model has such an embedding.
    """
    embedding = model.get_input_embeddings()
    if type(embedding) is nn.Embedding and embedding.max_norm is None and not embedding.scale_grad_by_freq and embeddings_tied(model):
        embedding.forward = MethodType(_embed_rows_into_weight_grad, embedding)
        return True
    return False


def load_pretrained(path: str, config: ModelConfig, hf_config: PretrainedConfig, dtype: torch.dtype, auto_class: type,
                    lora: LoRASettings | None, seed: int, added: AddedTokens | None) -> nn.Module:
    """The folder's model, whole, as build_model shards it: its token matrices grown for the `added` tokens, with
    the `lora` adapters."""
    pretrained_config = hf_config
    if added is not None:  # the folder's own rows, grown after loading
        pretrained_config = copy.deepcopy(hf_config)
        pretrained_config.get_text_config().vocab_size = added.pretrained_rows
    # transformers' own load report is a table with terminal colour codes, and for a value or reward head built on a
    # causal LM's folder its only news is that head: it is filtered out (a raised level would switch on transformers'
    # tensor-parallel plan check, with its own warning), and what else it would say is said plainly.
    report = logging.getLogger("transformers.modeling_utils")
    load_report = _DropLoadReport()
    report.addFilter(load_report)
    try:
        pretrained, info = model_class(hf_config, auto_class).from_pretrained(path, config=pretrained_config, dtype=dtype, trust_remote_code=config.trust_remote_code,
                                                      output_loading_info=True)
    finally:
        report.removeFilter(load_report)
    say_surprising_keys(pretrained, info, path, new_head=auto_class is not AutoModelForCausalLM)
    if added is not None:
        grow_embeddings(pretrained, hf_config.get_text_config().vocab_size, added, seed)
    if lora is not None:
        add_adapters(pretrained, lora, seed)
    return pretrained


class _DropLoadReport(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "LOAD REPORT" not in str(record.msg)


def say_surprising_keys(model: nn.Module, info: dict, path: str, new_head: bool) -> None:
    """Warn of the folder's weights that the model lacks and of the model's that the folder lacks, besides those a
    `new_head` (a critic's value head on a causal LM's folder, which leaves its output layer unused) explains."""
    body = model.base_model_prefix + "."
    missing = sorted(k for k in info["missing_keys"] if k.startswith(body) or not new_head)
    unused = sorted(k for k in info["unexpected_keys"] if k.startswith(body) or not new_head)
    if missing or unused:
        log.warning(f"{path}: {len(missing)} weight(s) the folder lacks, initialized at random ({', '.join(missing[:5]) or 'none'}); "
                    f"{len(unused)} of the folder's weight(s) unused ({', '.join(unused[:5]) or 'none'})")


def build_on_meta(hf_config: PretrainedConfig, config: ModelConfig, packed: bool, auto_class: type = AutoModelForCausalLM) -> nn.Module:
    """The model as `hf_config` builds it, on the meta device (no memory), with the attention its rows need: what
    the trainer shards, and what fsdptrain.check builds to find what cannot run."""
    architecture = read_architecture(hf_config)
    with torch.device("meta"):
        model = model_class(hf_config, auto_class).from_config(
            hf_config, attn_implementation=attention_setting(hf_config, attention_implementation(config, packed, architecture)),
            trust_remote_code=config.trust_remote_code)
    if packed and architecture.recurrent_layers:
        keep_sequences_apart(model)
    return model


def build_model(
    path: str, config: ModelConfig, fsdp: FSDPConfig, hf_config: PretrainedConfig, parallel: Parallel, packed: bool, trainable: bool,
    auto_class: type = AutoModelForCausalLM, lora: LoRASettings | None = None, seed: int = 0, added: AddedTokens | None = None,
) -> nn.Module:
    """The sharded model with the pretrained weights of `path`, on `parallel.device` (or CPU with offload).

    A frozen model (`trainable=False`, e.g. a reference policy) has no gradients and runs in eval mode; with
    `fsdp.cpu_offload` its parameters stay in host memory between uses. `auto_class` builds `hf_config` with
    another head (a critic's value head): weights that `path` lacks are initialized by rank 0 and sent to all.
    With `lora`, only the adapters train (initialized from `seed`, see models/lora.py) and the frozen weights are
    kept in the compute dtype (mixed_precision.param_dtype) rather than model_dtype. With `added` tokens, the token
    matrices have `hf_config.vocab_size` rows, the added tokens' drawn from `seed` (models/added_tokens.py); with
    a language model's freeze_llm, only those matrices train.
    """
    dtype = DTYPES[fsdp.model_dtype] if lora is None else compute_dtype(fsdp.mixed_precision.param_dtype, parallel.device)
    model = build_on_meta(hf_config, config, packed, auto_class).to(dtype)
    if lora is not None:
        add_adapters(model, lora, seed)
    if os.path.isfile(os.path.join(path, "generation_config.json")):
        model.generation_config = GenerationConfig.from_pretrained(path)
    if not trainable:
        model.requires_grad_(False)
        model.eval()
    elif isinstance(config, LanguageModelConfig) and config.freeze_llm:
        freeze_all_but_token_matrices(model)
    if trainable and isinstance(config, LanguageModelConfig) and config.freeze_vision_tower:
        vision_tower(model).requires_grad_(False)
    if trainable and config.enable_gradient_checkpointing:  # transformers 5 renamed the method; 4.x has only the old name
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if trainable and config.enable_activation_offload:
        offload_activations(model, parallel.device)
    apply_fsdp(model, parallel.sharding_mesh(fsdp.fsdp_size), fsdp, parallel.device)
    if is_vision_language(hf_config):
        run_tower_on_every_forward(model)
        keep_share_of_row(model)
    model.to_empty(device="cpu" if fsdp.cpu_offload else parallel.device)

    pretrained = load_pretrained(path, config, hf_config, dtype, auto_class, lora, seed, added) if parallel.is_main else None
    if parallel.rollout_ranks:  # torch's broadcast_from_rank0 would wait for the rollout ranks too: the training ranks' own
        options = StateDictOptions(full_state_dict=True, cpu_offload=fsdp.cpu_offload)
        set_model_state_dict(model, full_state_on_training_ranks(model, pretrained, parallel), options=options)
    else:
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, cpu_offload=fsdp.cpu_offload)
        set_model_state_dict(model, pretrained.state_dict() if pretrained is not None else {}, options=options)
    reference_buffers = dict(pretrained.named_buffers()) if pretrained is not None else {}
    for name, buffer in model.named_buffers():
        if parallel.is_main:
            buffer.copy_(reference_buffers[name])
        dist.broadcast(buffer, src=0, group=parallel.group)
    if fsdp.cpu_offload:  # parameters live on CPU, but the forward needs its buffers on the device
        for module in model.modules():
            for name, buffer in list(module.named_buffers(recurse=False)):
                setattr(module, name, buffer.to(parallel.device))
    return model


def full_state_on_training_ranks(model: nn.Module, pretrained: nn.Module | None, parallel: Parallel) -> dict[str, torch.Tensor]:
    """Rank 0's `pretrained` weights on every training rank, sent over their own group, each into a tensor of the
    sharded `model`'s full shape."""
    mine = pretrained.state_dict() if pretrained is not None else {}
    full = {}
    for name, sharded in model.state_dict().items():
        tensor = mine[name] if parallel.is_main else torch.empty(sharded.shape, dtype=sharded.dtype)
        tensor = tensor.to(parallel.device)
        dist.broadcast(tensor, src=0, group=parallel.group)
        full[name] = tensor
    return full
