"""Vision-language models: which train here, how they are built, and the 3-D rotary positions of their rows.

A vision-language model (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, GLM-4.1V and their MoE variants) is built with its vision
tower by AutoModelForImageTextToText, and with a value or score head (a critic, a reward model) by a token-
classification class registered here. Its decoder runs the trainer's packed attention; the tower keeps transformers'
own (its attention is bidirectional within each image, which the packed causal attention is not).

Its rotary positions are 3-D (mrope: time, height, width): an image's tokens take the positions of its patch grid
and the text after it continues from the largest. Each sample's positions are computed once, when it is made, by
the model's own `get_rope_index` over that sample alone, so a packed row, a shared prompt or a padded batch carries
each sample's positions as the model computes them for the sample on its own. A text-only sample's positions are
the plain ones on all three axes. Other multimodal models (audio, other vision towers) are refused by name.
"""

import inspect
import json
import os
from dataclasses import dataclass
from functools import cache, partial
from types import SimpleNamespace

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn
from transformers import (
    MODEL_MAPPING,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoModelForTokenClassification,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.modeling_outputs import TokenClassifierOutput

from fsdptrain.errors import ConfigError

# model type -> the text its chat template renders for one image (each image token is expanded to the image's count)
IMAGE_PLACEHOLDERS = {
    "qwen2_vl": "<|vision_start|><|image_pad|><|vision_end|>",
    "qwen2_5_vl": "<|vision_start|><|image_pad|><|vision_end|>",
    "qwen3_vl": "<|vision_start|><|image_pad|><|vision_end|>",
    "qwen3_vl_moe": "<|vision_start|><|image_pad|><|vision_end|>",
    "glm4v": "<|begin_of_image|><|image|><|end_of_image|>",
    "glm4v_moe": "<|begin_of_image|><|image|><|end_of_image|>",
}
MEDIA_CONFIGS = ("vision_config", "audio_config", "visual", "vision_tower")
# what the model's forward reads of a micro-batch's images, beside input_ids
IMAGE_INPUTS = ("pixel_values", "image_grid_thw")


def media_of(hf_config: PretrainedConfig) -> list[str]:
    return [name for name in MEDIA_CONFIGS if getattr(hf_config, name, None) is not None]


def is_vision_language(hf_config: PretrainedConfig) -> bool:
    return hf_config.model_type in IMAGE_PLACEHOLDERS


def check_supported(hf_config: PretrainedConfig, path_key: str, path: str) -> None:
    """A multimodal model other than the vision-language types above is refused, naming them."""
    media = media_of(hf_config)
    if media and not is_vision_language(hf_config):
        raise ConfigError(f"{path_key}={path!r} is a multimodal model ({hf_config.model_type}: {', '.join(media)}) that fsdptrain does not "
                          f"train; vision-language models supported: {', '.join(sorted(IMAGE_PLACEHOLDERS))}")


def model_class(hf_config: PretrainedConfig, auto_class: type) -> type:
    """The class that builds `hf_config`: a causal LM's Auto class builds a vision-language model with its tower;
    token classification (a critic's value head, a reward model's score) builds it with a head on its tower and
    decoder, which transformers does not have for these models and which is registered with the Auto class here."""
    if not is_vision_language(hf_config):
        return auto_class
    if auto_class is AutoModelForCausalLM:
        return AutoModelForImageTextToText
    if auto_class is AutoModelForTokenClassification:
        register_token_classification(type(hf_config))
    return auto_class


@cache
def register_token_classification(config_class: type[PretrainedConfig]) -> None:
    """A vision-language model's backbone (its vision tower and decoder, transformers' `...Model`) as `model` with a
    linear head `score` on the decoder's last hidden states, as transformers' token-classification models of text
    decoders have them. Its weights load from a vision-language model's folder as the model's own class loads them
    (transformers renames the keys of a folder's layout per class), the head drawn as transformers draws a new one."""
    backbone = MODEL_MAPPING[config_class]
    pretrained = next(c for c in backbone.__mro__ if c.__name__.endswith("PreTrainedModel") and c is not PreTrainedModel)

    class ForTokenClassification(pretrained):
        def __init__(self, config: PretrainedConfig):
            super().__init__(config)
            self.model = backbone(config)
            self.score = nn.Linear(config.get_text_config().hidden_size, config.num_labels)
            self.post_init()

        @classmethod
        def from_pretrained(cls, path: str, *, config: PretrainedConfig, output_loading_info: bool = False, **kwargs):
            whole, info = AutoModelForImageTextToText.from_pretrained(path, config=config, output_loading_info=True, **kwargs)
            with torch.device("meta"):
                model = cls(config)
            model.model = whole.model
            model.score = nn.Linear(model.score.in_features, model.score.out_features, dtype=whole.dtype)
            head = {name: folder_tensor(path, f"score.{name}") for name in ("weight", "bias")}
            if all(tensor is not None for tensor in head.values()):  # a folder written with its head (a reward model)
                model.score.load_state_dict(head)
                info = {**info, "unexpected_keys": {*info["unexpected_keys"]} - {"score.weight", "score.bias"}}
            else:
                nn.init.normal_(model.score.weight, std=config.get_text_config().initializer_range)
                nn.init.zeros_(model.score.bias)
                info = {**info, "missing_keys": {*info["missing_keys"], "score.weight", "score.bias"}}
            return (model, info) if output_loading_info else model

        def get_input_embeddings(self) -> nn.Module:
            return self.model.get_input_embeddings()

        def set_input_embeddings(self, value: nn.Module) -> None:
            self.model.set_input_embeddings(value)

        def forward(self, input_ids: torch.Tensor | None = None, **inputs) -> TokenClassifierOutput:
            return TokenClassifierOutput(logits=self.score(self.model(input_ids=input_ids, **inputs).last_hidden_state))

    ForTokenClassification.__name__ = ForTokenClassification.__qualname__ = backbone.__name__.removesuffix("Model") + "ForTokenClassification"
    # transformers decides what a class supports (setting its attention or experts implementation) by reading the
    # source of the module that defines it: this one's is the backbone's
    ForTokenClassification.__module__ = backbone.__module__
    AutoModelForTokenClassification.register(config_class, ForTokenClassification, exist_ok=True)


def folder_tensor(path: str, name: str) -> torch.Tensor | None:
    """The tensor `name` of a model folder's safetensors weights (one file or shards with their index), or None."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            file = json.load(f)["weight_map"].get(name)
    else:
        file = "model.safetensors" if os.path.isfile(os.path.join(path, "model.safetensors")) else None
    if file is None:
        return None
    with safe_open(os.path.join(path, file), framework="pt") as weights:
        return weights.get_tensor(name) if name in weights.keys() else None


def attention_setting(hf_config: PretrainedConfig, decoder_attention: str) -> str | dict[str, str]:
    """transformers' attn_implementation: `decoder_attention` for the text decoder; a vision tower keeps SDPA."""
    if not is_vision_language(hf_config):
        return decoder_attention
    return {"text_config": decoder_attention, "vision_config": "sdpa"}


def image_placeholder_ids(hf_config: PretrainedConfig) -> list[int]:
    """The tokens a vision-language model's forward takes for an image's or a video's place (none for a text
    model): a response cannot hold them."""
    if not is_vision_language(hf_config):
        return []
    return [i for i in (hf_config.image_token_id, getattr(hf_config, "video_token_id", None)) if i is not None]


VISION_TOWER_MODULES = r"model\.visual\..*"  # peft's exclude_modules (a regular expression) for the tower's modules


def vision_tower(model: nn.Module) -> nn.Module:
    """The vision encoder and its merger into the decoder's width (transformers names it `visual` in these models)."""
    return model.get_submodule("model.visual")


def run_tower_on_every_forward(model: nn.Module) -> None:
    """Make a sharded vision-language model run its vision tower in every forward, on a blank image where the
    micro-batch has none, its output added times 0 to the token embeddings (where real images join them).

    Each FSDP unit of the tower gathers its weights in the forward and reduces its gradients in the backward, and
    every rank must run those collectives in the same order: a rank whose micro-batch has no image would otherwise
    skip them while another runs them, and the gathers of different units would pair up across ranks."""
    tower, seen = vision_tower(model), SimpleNamespace(images=True)
    vision = model.config.vision_config
    channels = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    side = 2 * vision.spatial_merge_size
    model.get_submodule("model").register_forward_pre_hook(partial(_note_images, seen), with_kwargs=True)
    model.get_input_embeddings().register_forward_hook(partial(_blank_image, seen, tower, channels, side))


def keep_share_of_row(model: nn.Module) -> None:
    """Under Ulysses, let a vision-language model take a packed row whole and its text decoder keep this rank's
    share of it: the images' features are merged into the token embeddings by the positions of their image tokens
    in the whole row, and then the embeddings, the 3-D positions and Qwen3-VL's deepstack features (added to the
    visual positions' hidden states in the first layers) are cut to this rank's slice. A row that comes cut already
    (a text row) is left as it is."""
    model.get_submodule("model.language_model").register_forward_pre_hook(_share_of_row, with_kwargs=True)


def _share_of_row(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    group, embeddings, boundaries = kwargs.get("sp_group"), kwargs.get("inputs_embeds"), kwargs.get("cu_seq_lens_q")
    if group is None or embeddings is None or boundaries is None or embeddings.shape[1] != int(boundaries[-1]):
        return None
    width = embeddings.shape[1] // dist.get_world_size(group)
    low, high = dist.get_rank(group) * width, (dist.get_rank(group) + 1) * width
    kwargs = {**kwargs, "inputs_embeds": embeddings[:, low:high], "position_ids": kwargs["position_ids"][..., low:high]}
    visual = kwargs.get("visual_pos_masks")
    if visual is not None:  # deepstack's features are in the order of the visual positions: this slice's are a run of them
        first, last = int(visual[:, :low].sum()), int(visual[:, :high].sum())
        kwargs["visual_pos_masks"] = visual[:, low:high]
        kwargs["deepstack_visual_embeds"] = [features[first:last] for features in kwargs["deepstack_visual_embeds"]]
    return args, kwargs


def _note_images(seen: SimpleNamespace, module: nn.Module, args: tuple, kwargs: dict) -> None:
    seen.images = kwargs.get("pixel_values") is not None


def _blank_image(seen: SimpleNamespace, tower: nn.Module, channels: int, side: int, module: nn.Module, args: tuple,
                 embeddings: torch.Tensor) -> torch.Tensor | None:
    if seen.images:
        return None
    blank = embeddings.new_zeros(side * side, channels)
    output = tower(blank, grid_thw=torch.tensor([[1, side, side]], device=embeddings.device))
    return embeddings + 0.0 * sum(t.float().sum() for t in _tensors(output)).to(embeddings.dtype)


def _tensors(output) -> list[torch.Tensor]:
    """The floating tensors of a tower's output (a tensor, a tuple, or a model output with pooled and deepstack
    features)."""
    if isinstance(output, torch.Tensor):
        return [output] if output.is_floating_point() else []
    values = output.values() if isinstance(output, dict) else output if isinstance(output, (list, tuple)) else []
    return [t for value in values for t in _tensors(value)]


@dataclass(frozen=True)
class ImageTokens:
    """What turns a sample's images into its tokens: the placeholder its chat template renders, the token each image
    expands, the patches merged into one token, and the model whose `get_rope_index` gives 3-D positions."""

    placeholder: str
    image_token_id: int
    merge: int
    rope_model: nn.Module  # the model on the meta device: get_rope_index reads only its config
    token_types: bool  # its get_rope_index takes mm_token_type_ids (transformers 5)

    def count(self, grid_thw: torch.Tensor) -> int:
        """Tokens of an image of patch grid (t, h, w)."""
        return int(grid_thw.prod()) // self.merge**2

    def positions(self, input_ids: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
        """(3, length) rotary positions of one sample with images, as the model computes them for it alone (a text
        sample's are the plain ones on all three axes, filled in where it is collated)."""
        ids = input_ids[None]
        kwargs = {"image_grid_thw": image_grid_thw}
        if self.token_types:
            kwargs["mm_token_type_ids"] = (ids == self.image_token_id).int()
        positions, _ = self.rope_model.get_rope_index(ids, **kwargs)
        return positions[:, 0]


def image_tokens(hf_config: PretrainedConfig) -> ImageTokens:
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(hf_config).model
    return ImageTokens(IMAGE_PLACEHOLDERS[hf_config.model_type], hf_config.image_token_id, hf_config.vision_config.spatial_merge_size,
                       model, "mm_token_type_ids" in inspect.signature(model.get_rope_index).parameters)
