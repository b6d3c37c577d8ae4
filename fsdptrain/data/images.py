"""A row's images, as verl's datasets read them: the `data.image_key` column holds a list of images per row (each as
{"bytes": ...}, {"path": ...}, raw bytes or a file path), and each `<image>` in the row's text stands for the next.

The model's image processor turns each image into patches (`pixel_values`) and its patch grid (`image_grid_thw`);
the `<image>` becomes the placeholder the model's chat template renders for an image, and its image token is then
repeated once per merged patch, as the model's processor expands it. The image tokens are never training targets.
"""

import io
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from PIL import Image
from transformers import AutoImageProcessor, PretrainedConfig, PreTrainedTokenizerBase

from fsdptrain.data.chat import RowError
from fsdptrain.errors import ConfigError
from fsdptrain.models.vision import IMAGE_INPUTS, ImageTokens, image_tokens, is_vision_language

IMAGE_MARK = "<image>"


@dataclass(frozen=True)
class Images:
    """A prompt's images as the model reads them (`pixel_values`, `image_grid_thw`), with the prompt's (3, length)
    rotary positions: what a rollout engine prefills and what each of its responses' samples carries."""

    inputs: dict[str, torch.Tensor]
    positions: torch.Tensor

    def positions_through(self, length: int) -> torch.Tensor:
        """(3, length) positions of the prompt followed by text up to `length` tokens: each text token one past the
        largest position before it, on all three axes."""
        extra = length - self.positions.shape[1]
        return torch.cat([self.positions, (self.positions.max() + 1 + torch.arange(extra)).expand(3, -1)], dim=1)


@dataclass(frozen=True)
class ImageReader:
    """Reads the images of rows for one model: its image processor and its image tokens."""

    key: str  # data.image_key
    processor: object  # the model folder's image processor (transformers' AutoImageProcessor)
    tokens: ImageTokens

    def read(self, values: Sequence | None, texts: Sequence[str]) -> dict[str, torch.Tensor] | None:
        """The model's inputs of a row's images (None for a row without), checked against the `<image>` marks of
        its `texts`."""
        values = list(values or [])
        marks = sum(text.count(IMAGE_MARK) for text in texts)
        if marks != len(values):
            raise RowError(f"{marks} {IMAGE_MARK} mark(s) in the text but {len(values)} image(s) in column {self.key!r}")
        if not values:
            return None
        images = [open_image(value, i) for i, value in enumerate(values)]
        try:
            inputs = self.processor(images=images, return_tensors="pt")
        except Exception as e:  # the processors raise several types for an image they cannot use
            raise RowError(f"column {self.key!r}: the image processor cannot use the images: {e}") from None
        return {name: inputs[name] for name in IMAGE_INPUTS}

    def expand(self, ids: list[int], mask: list[int], images: dict[str, torch.Tensor] | None) -> tuple[list[int], list[int]]:
        """Each image token of a tokenized sample repeated to its image's token count (never a target)."""
        image_id = self.tokens.image_token_id
        at = [i for i, token in enumerate(ids) if token == image_id]
        grids = images["image_grid_thw"] if images is not None else []
        if len(at) != len(grids):
            raise RowError(f"the text holds {len(at)} image token(s) (id {image_id}) for {len(grids)} image(s): an image token written "
                           f"in the text itself, or {IMAGE_MARK} inside a turn the chat template drops")
        out_ids, out_mask, start = [], [], 0
        for position, grid in zip(at, grids):
            out_ids += ids[start:position] + [image_id] * self.tokens.count(grid)
            out_mask += mask[start:position] + [0] * self.tokens.count(grid)
            start = position + 1
        return out_ids + ids[start:], out_mask + mask[start:]

    def mark(self, text: str) -> str:
        """`text` with each `<image>` as the model's chat template renders an image."""
        return text.replace(IMAGE_MARK, self.tokens.placeholder)

    def one_token_each(self, ids: list[int]) -> list[int]:
        """`ids` with each image's run of image tokens as one (as the text of `mark` tokenizes before `expand`)."""
        image_id = self.tokens.image_token_id
        return [token for i, token in enumerate(ids) if token != image_id or i == 0 or ids[i - 1] != image_id]


def open_image(value, index: int) -> Image.Image:
    """One image of a row, as verl's datasets store it, in RGB."""
    try:
        if isinstance(value, dict):
            if value.get("bytes") is not None:
                image = Image.open(io.BytesIO(value["bytes"]))
            elif value.get("path") or value.get("image"):
                image = Image.open(value.get("path") or value.get("image"))
            else:
                raise ValueError(f"a dict without bytes or path (keys {sorted(value)})")
        elif isinstance(value, bytes):
            image = Image.open(io.BytesIO(value))
        elif isinstance(value, str):
            image = Image.open(re.sub(r"^file://", "", value))
        else:
            raise ValueError(f"a {type(value).__name__}, not bytes, a path or a dict of them")
        return image.convert("RGB")
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise RowError(f"image {index} cannot be read: {e}") from None


def load_image_processor(path: str, trust_remote_code: bool):
    """The image processor of a model folder (transformers' PIL one where torchvision is missing)."""
    if not os.path.isfile(os.path.join(path, "preprocessor_config.json")):
        return None
    return AutoImageProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)


def image_reader(path: str, path_key: str, key: str, tokenizer: PreTrainedTokenizerBase, hf_config: PretrainedConfig,
                 trust_remote_code: bool) -> ImageReader | None:
    """The reader of a vision-language model's folder (None for a text model's), or an error naming what the folder
    lacks."""
    if not is_vision_language(hf_config):
        return None
    processor = load_image_processor(path, trust_remote_code)
    if processor is None:
        raise ConfigError(f"{path_key}={path!r} is a vision-language model without its image processor (no preprocessor_config.json)")
    tokens = image_tokens(hf_config)
    pieces = re.findall(r"<\|[^|]+\|>", tokens.placeholder)  # the image's start, its token, its end
    ids = [tokenizer.convert_tokens_to_ids(piece) for piece in pieces]
    if any(i in (None, tokenizer.unk_token_id) for i in ids) or ids[1] != tokens.image_token_id:
        raise ConfigError(f"{path_key}={path!r}: the tokenizer does not write images as the model reads them ({' '.join(pieces)} as tokens, "
                          f"{pieces[1]} the config's image_token_id {tokens.image_token_id}); it gives ids {ids}")
    return ImageReader(key, processor, tokens)


def check_reads_images_alike(reader: ImageReader | None, policy_type: str, path: str, hf_config: PretrainedConfig, key: str,
                             trust_remote_code: bool) -> None:
    """A model that reads the policy's samples (a critic, a reward model, a distillation teacher) is given the policy's image inputs, image
    tokens and 3-D positions as they are: where the policy reads images (`reader`), it must be a vision-language
    model of the policy's type with the same image processor and image tokens, or it is refused naming `key`."""
    if reader is None:
        return
    processor = load_image_processor(path, trust_remote_code) if is_vision_language(hf_config) else None
    if not (processor is not None and hf_config.model_type == policy_type and hf_config.image_token_id == reader.tokens.image_token_id
            and hf_config.vision_config.spatial_merge_size == reader.tokens.merge and processor.to_dict() == reader.processor.to_dict()):
        found = hf_config.model_type if processor is not None or not is_vision_language(hf_config) else f"{hf_config.model_type} without an image processor"
        raise ConfigError(f"{key}={path!r} ({found}) does not read images as actor_rollout_ref.model.path ({policy_type}) does: it scores "
                          f"the policy's image samples, so it must be a {policy_type} model with the same image processor and image tokens")
