"""What a model's architecture asks of the trainer's paths, read once from its config, and the refusals where a
path cannot be right.

Each path (packed rows, a shared prompt, padded rows, the rollout engines, Ulysses) either honours what the
architecture declares or is refused here, before any process starts, with the model type, the feature and the key to
change. What the attention honours for every model (sliding windows, sinks, value heads of their own size) is
models/attention.py's; what needs a decision per model is below:

- layers with a recurrent state (hybrid linear attention: Qwen3-Next's gated delta rule) carry each sequence's state
  from its first token to its last. Packed rows run them one sequence at a time (keep_sequences_apart); a shared
  prompt would have to hand its state to each response, so its responses are packed whole instead; under Ulysses
  these layers gather the whole row.
- dropout in the model's config (Seed-OSS ships attention and residual dropout) makes the update's forward noisy, so
  the old policy's log-probs are taken by their own pass in eval mode, as verl takes them, not from the update's.
- a model that transformers' SDPA attention does not support (gpt-oss: its sinks) runs padded rows in eager attention.
- the hf engine's prefill computes the keys and values of a batch's common prompt prefix once, the rest of each
  prompt padded after it: only where every layer attends to every earlier key. A windowed layer (Mistral, Gemma 3,
  gpt-oss) counts its window in the cache's columns, which the padding would widen, and a recurrent one reads the pads.
- an MoE model whose config asks for the routers' load-balancing loss (`output_router_logits`) trains with it, per
  sequence (models/router_balance.py), its prompts packed with each response.
"""

from dataclasses import dataclass
from functools import partial
from types import MethodType

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
from torch import nn
from transformers import PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from fsdptrain.models.router_balance import RouterBalance, router_balance
from fsdptrain.models.vision import is_vision_language

LINEAR_ATTENTION = "linear_attention"
# transformers' names for dropout probabilities in model configs; classifier_dropout is a head's (the critic's is set to 0)
DROPOUT_KEYS = ("attention_dropout", "hidden_dropout", "residual_dropout", "dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop",
                "hidden_dropout_prob", "attention_probs_dropout_prob", "activation_dropout", "ffn_dropout")


@dataclass(frozen=True)
class Architecture:
    model_type: str
    recurrent_layers: bool  # linear-attention layers whose state runs through a sequence
    supports_sdpa: bool  # transformers' SDPA attention implements the model
    dropout: tuple[str, ...]  # the config's dropout keys above 0
    router_balance: RouterBalance | None  # the MoE routers' load-balancing loss the config asks for
    vision_language: bool = False  # a vision tower reads the prompts' images (models/vision.py)
    full_attention: bool = True  # every layer attends to every key before it (no window, chunk or recurrent state)

    @property
    def shares_batch_prefix(self) -> bool:
        """Whether the hf engine may prefill a batch's common prompt prefix once (the module's docstring)."""
        return self.full_attention and not self.vision_language

    @property
    def shares_prompts(self) -> bool:
        """Whether a packed row may hold a group's prompt once for its responses: not with recurrent layers, nor with
        a load-balancing loss, which counts each sequence's prompt rows as transformers counts them on it alone."""
        return not self.recurrent_layers and self.router_balance is None


def read_architecture(hf_config: PretrainedConfig) -> Architecture:
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(hf_config), None)
    dropout = tuple(key for key in DROPOUT_KEYS if isinstance(getattr(text, key, None), float) and getattr(text, key) > 0)
    layer_types = getattr(text, "layer_types", None)
    full_attention = (all(kind == "full_attention" for kind in layer_types) if layer_types else getattr(text, "sliding_window", None) is None
                      ) and getattr(text, "attention_chunk_size", None) is None
    return Architecture(
        model_type=hf_config.model_type,
        recurrent_layers=LINEAR_ATTENTION in (layer_types or ()),
        supports_sdpa=model_class is None or bool(getattr(model_class, "_supports_sdpa", False)),
        dropout=dropout,
        router_balance=router_balance(text),
        vision_language=is_vision_language(hf_config),
        full_attention=full_attention,
    )


def padded_attention(architecture: Architecture, asked: str) -> str:
    """The attention implementation of padded rows: `asked`, or with `auto` SDPA where transformers implements the
    model with it, else eager."""
    if asked != "auto":
        return asked
    return "sdpa" if architecture.supports_sdpa else "eager"


# ---- recurrent layers over packed rows ----------------------------------------------------------------------------
PACKED_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "key_rows", "position_ids", "sp_group")


def keep_sequences_apart(model: nn.Module) -> None:
    """Run each linear-attention mixer of `model` (a decoder layer's `linear_attn`) one packed sequence at a time.

    The sequence boundaries reach the mixer from its decoder layer's keyword arguments (`cu_seq_lens_q`, which the
    trainer's packed rows carry) through a pre-hook: not every transformers version passes them on to the mixer.
    Under Ulysses (`sp_group` among them) a rank holds a slice of the row: the mixer gathers the whole row (its
    gradient summed back to each slice's rank), runs every sequence, and keeps its slice of the output."""
    for layer in model.modules():
        mixer = getattr(layer, "linear_attn", None)
        if isinstance(mixer, nn.Module):
            mixer.packed_boundaries, mixer.packed_sp_group = None, None
            layer.register_forward_pre_hook(partial(_note_boundaries, mixer), with_kwargs=True)
            mixer.forward = MethodType(partial(_per_sequence, type(mixer).forward), mixer)


def _note_boundaries(mixer: nn.Module, layer: nn.Module, args: tuple, kwargs: dict) -> None:
    mixer.packed_boundaries, mixer.packed_sp_group = kwargs.get("cu_seq_lens_q"), kwargs.get("sp_group")


def _per_sequence(forward, mixer: nn.Module, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    boundaries, group = mixer.packed_boundaries, mixer.packed_sp_group
    if boundaries is None:
        return forward(mixer, hidden_states, *args, **kwargs)
    kwargs = {k: v for k, v in kwargs.items() if k not in PACKED_KWARGS}
    row = hidden_states if group is None else torch.cat(dist_nn.all_gather(hidden_states.contiguous(), group=group), dim=1)
    lengths = (boundaries[1:] - boundaries[:-1]).tolist()
    output = torch.cat([forward(mixer, piece, *args, **kwargs) for piece in row.split(lengths, dim=1)], dim=1)
    if group is None:
        return output
    width = hidden_states.shape[1]
    return output[:, dist.get_rank(group) * width : (dist.get_rank(group) + 1) * width]
