"""Vision-language models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL and its MoE, GLM-4.1V and its MoE): images read from rows
in verl's layout give a plain transformers forward's per-token log-probs on every path (a packed row, its second
sequence included; a shared prompt; padded rows; rollouts, beams, multi-turn trajectories; a critic's values, a
reward model's scores, a teacher's top-k), and SFT and GRPO train them on 2 processes in every mode.

The reference is written without the trainer's code: the image marks expanded in the text as transformers'
processors expand them, tokenized, and one forward per sequence with `mm_token_type_ids` (the model then computes
its own 3-D positions), eager attention, float32."""

import io
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from transformers import AutoConfig, AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

from fsdptrain.config.shared import ModelConfig
from fsdptrain.data.dataset import DataError, Sample, load_sft_samples
from fsdptrain.data.images import image_reader
from fsdptrain.data.micro_batches import collate_packed, collate_padded
from fsdptrain.models.loading import build_on_meta
from fsdptrain.models.loss import token_log_probs, token_nll_sum, token_top_k
from fsdptrain.trainer.sft_plan import plan_sft, read_sft_config

import make_tiny
from conftest import assert_same_run, assert_same_weights, hf_weights, read_metrics, run_sft, torchrun

ARCHITECTURES = sorted(make_tiny.VISION_LANGUAGE)
LOADING = ModelConfig(trust_remote_code=False, enable_gradient_checkpointing=False, attn_implementation="auto")


def picture(seed: int, height: int, width: int) -> bytes:
    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module", params=ARCHITECTURES)
def vl_folder(request, tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp(request.param)
    make_tiny.tiny_vision_language(request.param, make_tiny.trained_tokenizer(), seed=0, out=str(path))
    return str(path)


def chats() -> list[dict]:
    """verl's multimodal SFT rows: `<image>` marks in the messages, the images beside them (two sizes, two images
    in one row, and a text-only row)."""
    return [
        {"messages": [{"role": "user", "content": "<image>what is 3 + 4?"}, {"role": "assistant", "content": "3 + 4 = 7"}],
         "images": [{"bytes": picture(0, 20, 28), "path": None}]},
        {"messages": [{"role": "user", "content": "compare <image> and <image>"}, {"role": "assistant", "content": "12 and 21"}],
         "images": [{"bytes": picture(1, 32, 16), "path": None}, {"bytes": picture(2, 16, 16), "path": None}]},
        {"messages": [{"role": "user", "content": "what is 5 + 6?"}, {"role": "assistant", "content": "5 + 6 = 11"}], "images": []},
        {"messages": [{"role": "user", "content": "<image>count"}, {"role": "assistant", "content": "2 + 2 = 4, so 4"}],
         "images": [{"bytes": picture(3, 24, 24), "path": None}]},
    ]


def write_rows(path, rows: list[dict]) -> str:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def sft_data(folder: str, path) -> list[Sample]:
    config = read_sft_config(plan_args(folder, str(path)))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    reader = image_reader(folder, "model.partial_pretrain", "images", tokenizer, AutoConfig.from_pretrained(folder), False)
    return load_sft_samples([str(path)], tokenizer, plan_sft(config).data, reader)


def plan_args(folder: str, data: str):
    from fsdptrain.check import composed

    return composed("sft_trainer", [f"data.train_files={data}", "data.multiturn.enable=true", f"model.partial_pretrain={folder}",
                                    "data.max_length=512", "data.train_batch_size=4"])


def reference_inputs(folder: str, row: dict, generation_prompt: bool = False) -> dict:
    """A row's model inputs as transformers' processors make them: each image mark becomes the placeholder with its
    image token repeated once per merged patch, in the text, before tokenizing (with the next assistant turn's
    opening where `generation_prompt`)."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    processor = AutoImageProcessor.from_pretrained(folder)
    config = AutoConfig.from_pretrained(folder)
    placeholder = make_tiny.VISION_LANGUAGE[config.model_type][0]
    start, image, end = (placeholder[k] for k in list(placeholder)[:3])
    images = [Image.open(io.BytesIO(i["bytes"])).convert("RGB") for i in row["images"]]
    inputs = processor(images=images, return_tensors="pt") if images else {}
    grids = iter(inputs.get("image_grid_thw", []))
    messages = [{**m, "content": m["content"]} for m in row["messages"]]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    pieces = text.split("<image>")
    text = pieces[0] + "".join(start + image * (int(next(grids).prod()) // 4) + end + piece for piece in pieces[1:])
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"])
    out = {"input_ids": ids[None], "mm_token_type_ids": (ids == config.image_token_id).int()[None]}
    if images:
        out.update(pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"])
    return out


def plain(folder: str) -> torch.nn.Module:
    return AutoModelForImageTextToText.from_pretrained(folder, attn_implementation="eager", dtype=torch.float32).eval()


def as_trained(folder: str, packed: bool, reference: torch.nn.Module) -> torch.nn.Module:
    model = build_on_meta(AutoConfig.from_pretrained(folder), LOADING, packed)
    model.to_empty(device="cpu")
    model.load_state_dict(reference.state_dict())
    model.tie_weights()
    buffers = dict(reference.named_buffers())
    for name, buffer in model.named_buffers():
        buffer.copy_(buffers[name])
    return model.eval()


def plain_inputs(reference, processor, ids: list[int], images: list[dict]) -> dict:
    """One sequence's inputs to a plain transformers forward with its row's images (the model computes its own 3-D
    positions from `mm_token_type_ids`)."""
    ids = torch.tensor(ids)
    inputs = {"input_ids": ids[None], "mm_token_type_ids": (ids == reference.config.image_token_id).int()[None]}
    if images:
        inputs.update(processor(images=[Image.open(io.BytesIO(i["bytes"])).convert("RGB") for i in images], return_tensors="pt"))
    return inputs


def plain_logits(reference, processor, ids: list[int], images: list[dict]) -> torch.Tensor:
    with torch.no_grad():
        return reference(**plain_inputs(reference, processor, ids, images)).logits[0]


def trained_positions(values: torch.Tensor, samples: list[Sample]) -> list[torch.Tensor]:
    """A packed row's per-position values (log-probs, top-k) cut into each sample's, at the positions that predict
    its trained tokens."""
    pieces, start = [], 0
    for sample in samples:
        pieces.append(values[start : start + len(sample) - 1][sample.loss_mask[1:].bool()])
        start += len(sample)
    return pieces


def test_rows_become_the_processors_ids_and_every_path_gives_a_plain_forwards_log_probs(vl_folder, tmp_path):
    # the last row asks the first row's question of another image of its size: the same ids, other patches
    rows = chats() + [{**chats()[0], "images": [{"bytes": picture(9, 20, 28), "path": None}]}]
    samples = sft_data(vl_folder, write_rows(tmp_path / "chat.parquet", rows))
    reference = plain(vl_folder)
    expected = []
    for sample, row in zip(samples, rows):
        inputs = reference_inputs(vl_folder, row)
        assert sample.input_ids.tolist() == inputs["input_ids"][0].tolist()
        assert (sample.images is None) == (not row["images"])
        with torch.no_grad():
            logits = reference(**inputs).logits[0]
        expected.append(logits[:-1].log_softmax(-1).gather(1, sample.input_ids[1:, None]).squeeze(1)[sample.loss_mask[1:].bool()])
    # groups sharing an image prompt (an RL group's layout): two responses after the first sample's user turn, then
    # two after the last sample's, whose ids are the same: only its image tells the two groups apart
    prompt_length = int(samples[0].loss_mask.nonzero()[0])
    assert torch.equal(samples[0].input_ids, samples[-1].input_ids)
    shared = [Sample(torch.cat([owner.input_ids[:prompt_length], torch.tensor(response)]),
                     torch.cat([torch.zeros(prompt_length, dtype=torch.long), torch.ones(len(response), dtype=torch.long)]),
                     shared_prefix=prompt_length, images=owner.images)
              for owner in (samples[0], samples[-1]) for response in ([5, 9, 13, 2], [40, 41])]
    for sample in shared:
        with torch.no_grad():
            inputs = {"input_ids": sample.input_ids[None], "mm_token_type_ids": (sample.input_ids == reference.config.image_token_id).int()[None],
                      **sample.images}
            logits = reference(**inputs).logits[0]
        expected.append(logits[:-1].log_softmax(-1).gather(1, sample.input_ids[1:, None]).squeeze(1)[sample.loss_mask[1:].bool()])
    reader = image_reader(vl_folder, "model", "images", AutoTokenizer.from_pretrained(vl_folder), reference.config, False)
    for sample in shared:
        sample.positions = reader.tokens.positions(sample.input_ids, sample.images["image_grid_thw"])
    everything = samples + shared

    for layout, packed, share in (("packed", True, False), ("shared prompt", True, True), ("padded", False, False)):
        model = as_trained(vl_folder, packed, reference)
        batch = collate_packed(everything, share_prefixes=share) if packed else collate_padded(everything, pad_token_id=0)
        with torch.no_grad():
            log_probs, _ = token_log_probs(model, batch.inputs, batch.targets["labels"], 1.0, chunk_tokens=16, token_rows=batch.token_rows)
        width = None if packed else batch.inputs["input_ids"].shape[1]
        start = 0
        for index, (sample, want) in enumerate(zip(everything, expected)):
            begin = index * width if width else start
            got = log_probs.reshape(-1)[begin : begin + len(sample) - 1][sample.loss_mask[1:].bool()]
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0, msg=f"{layout}: sample {index}")
            start += len(sample)
        if layout == "packed":
            with torch.no_grad():
                nll = token_nll_sum(model, batch.inputs, batch.targets["labels"], chunk_tokens=16)
            torch.testing.assert_close(nll, -sum(e.sum() for e in expected), atol=1e-3, rtol=1e-5)


def test_bad_image_rows_are_refused_naming_the_row(tmp_path):
    folder = tmp_path / "model"
    make_tiny.tiny_vision_language("qwen2_5_vl", make_tiny.trained_tokenizer(), seed=0, out=str(folder))
    good = chats()[0]
    cases = {
        "unreadable": ({**good, "images": [{"bytes": b"not an image", "path": None}]}, "image 0 cannot be read"),
        "marks": ({**good, "images": good["images"] * 2}, "1 <image> mark(s) in the text but 2 image(s)"),
        "too long": ({"messages": [{"role": "user", "content": "<image>" * 80}, good["messages"][1]], "images": good["images"] * 80},
                     "exceed data.max_length=512"),
        "missing file": ({**good, "images": [{"bytes": None, "path": str(tmp_path / "gone.png")}]}, "image 0 cannot be read"),
    }
    for name, (row, message) in cases.items():
        path = write_rows(tmp_path / f"{name}.parquet", [chats()[2], row])
        with pytest.raises(DataError, match="row 1: .*" + message.replace("(", r"\(").replace(")", r"\)")):
            sft_data(str(folder), path)


@pytest.mark.slow
def test_sft_trains_a_vision_language_model_the_same_on_1_and_2_processes_and_resumes_exactly(tmp_path):
    folder = tmp_path / "model"
    make_tiny.tiny_vision_language("qwen2_5_vl", make_tiny.trained_tokenizer(), seed=0, out=str(folder))
    rows = chats() * 4
    data = {"train": write_rows(tmp_path / "train.parquet", rows), "val": write_rows(tmp_path / "val.parquet", chats())}
    common = dict(data__multiturn__enable="true", data__max_length="512", data__train_batch_size="4",
                  optim__lr="1e-3", model__fsdp_config__model_dtype="fp32", trainer__save_freq="2",
                  trainer__checkpoint__save_contents="[model,optimizer,extra,hf_model]")
    one = str(tmp_path / "one")
    run_sft(1, str(folder), data, one, **common, trainer__total_training_steps="4")
    two = str(tmp_path / "two")  # one sample a forward: a rank's forward without an image beside another's with one
    run_sft(2, str(folder), data, two, **common, trainer__total_training_steps="4", data__use_dynamic_bsz="false",
            data__micro_batch_size_per_gpu="1")
    assert_same_run(two, one)
    losses = [m["train/loss"] for m in read_metrics(one) if "train/loss" in m]
    assert losses[-1] < losses[0]
    resumed = str(tmp_path / "resumed")  # the 2-process run as if stopped after its step-2 checkpoint
    shutil.copytree(two, resumed, ignore=shutil.ignore_patterns("global_step_4"))
    Path(resumed, "latest_checkpointed_iteration.txt").write_text("2")
    run_sft(2, str(folder), data, resumed, **common, trainer__total_training_steps="4", data__use_dynamic_bsz="false",
            data__micro_batch_size_per_gpu="1")
    assert [m["step"] for m in read_metrics(resumed)] == [1, 2, 3, 4]
    assert_same_run(resumed, two)
    exported = f"{two}/global_step_4/huggingface"
    assert json.load(open(f"{exported}/preprocessor_config.json"))["patch_size"] == 4
    pretrained = load_file(str(folder / "model.safetensors"))
    trained = hf_weights(f"{two}/global_step_4")
    assert trained.keys() == pretrained.keys()
    tower = [name for name in pretrained if name.startswith("visual.")]
    assert tower and all(not torch.equal(trained[name], pretrained[name]) for name in tower if name.endswith("weight"))
    assert AutoModelForImageTextToText.from_pretrained(exported).config.model_type == "qwen2_5_vl"

    frozen = str(tmp_path / "frozen")
    run_sft(1, str(folder), data, frozen, **common, trainer__total_training_steps="2", model__freeze_vision_tower="true")
    trained = hf_weights(f"{frozen}/global_step_2")
    assert all(torch.equal(trained[name], pretrained[name]) for name in tower)
    assert not torch.equal(trained["model.layers.0.mlp.up_proj.weight"], pretrained["model.layers.0.mlp.up_proj.weight"])


# ---- GRPO: image prompts in verl's RL layout, rolled out by the hf engine ------------------------------------------
RL_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": solution_str.count("4") / max(len(solution_str), 1), "acc": float("4" in solution_str)}
"""


def rl_rows(count: int) -> list[dict]:
    """geo3k's layout: the prompt's messages with `<image>` marks, the row's images, every fourth row text only."""
    rows = []
    for i in range(count):
        text_only = i % 4 == 3
        content = "what is 2 + 2?" if text_only else "<image>" * (1 + i % 2) + "what is 2 + 2?"
        images = [] if text_only else [{"bytes": picture(10 + i + k, 16 + 8 * (i % 3), 24), "path": None} for k in range(1 + i % 2)]
        rows.append({"prompt": [{"role": "user", "content": content}], "images": images, "data_source": "shapes",
                     "reward_model": {"ground_truth": "4", "style": "rule"}})
    return rows


IMAGE_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None, images=None):
    return {"score": float(len(images)), "first_red": float(images[0].getpixel((0, 0))[0]) if images else -1.0,
            "first_width": float(images[0].size[0]) if images else -1.0}
"""


def rl_run_files(tmp_path, rows: list[dict]) -> tuple[Path, Path]:
    """A tiny Qwen2.5-VL's folder and a data folder with `rows` as rl_train.parquet and RL_REWARD as reward.py."""
    folder, data = tmp_path / "model", tmp_path / "data"
    make_tiny.tiny_vision_language("qwen2_5_vl", make_tiny.trained_tokenizer(), seed=0, out=str(folder))
    data.mkdir()
    write_rows(data / "rl_train.parquet", rows)
    (data / "reward.py").write_text(RL_REWARD)
    return folder, data


def test_a_reward_function_that_asks_for_images_is_given_each_rows_images(tmp_path):
    """A reward function with an `images` parameter gets its prompt's images (RGB, in their marks' order; none
    for a text row), on its own and as a reward source; one without it is called as verl calls it."""
    from fsdptrain.rl.data import load_prompts
    from fsdptrain.rl.rewards import load_reward_function, load_reward_sources, score_responses, weighted_sources
    from fsdptrain.rl.rollout.base import Generation

    folder = tmp_path / "model"
    make_tiny.tiny_vision_language("qwen2_5_vl", make_tiny.trained_tokenizer(), seed=0, out=str(folder))
    rows = rl_rows(4)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    reader = image_reader(str(folder), "model", "images", tokenizer, AutoConfig.from_pretrained(folder), False)
    prompts = load_prompts([write_rows(tmp_path / "rl.parquet", rows)], tokenizer, images=reader)
    (tmp_path / "reward.py").write_text(IMAGE_REWARD + RL_REWARD.replace("def compute_score", "def text_only"))
    responses = [Generation(p.ids, tokenizer("2 + 2 = 4", add_special_tokens=False)["input_ids"], [1] * 7, None, False) for p in prompts]
    want = []
    for row in rows:
        first = Image.open(io.BytesIO(row["images"][0]["bytes"])).convert("RGB") if row["images"] else None
        want.append({"score": float(len(row["images"])), "first_red": float(first.getpixel((0, 0))[0]) if first else -1.0,
                     "first_width": float(first.size[0]) if first else -1.0})
    assert [len(row["images"]) for row in rows] == [1, 2, 1, 0]
    seeing = load_reward_function(str(tmp_path / "reward.py"), None)
    scored = score_responses(seeing, tokenizer, prompts, responses, [0, 1, 2, 3], "")
    assert [{k: s[k] for k in want[0]} for s in scored] == want
    sources = weighted_sources(load_reward_sources([SimpleNamespace(name="seen", path=str(tmp_path / "reward.py"), function="compute_score",
                                                                    weight=2.0)]))
    assert [s["score"] for s in score_responses(sources, tokenizer, prompts, responses, [0, 1, 2, 3], "")] == [2 * w["score"] for w in want]
    blind = load_reward_function(str(tmp_path / "reward.py"), "text_only")
    assert all(s["acc"] == 1.0 for s in score_responses(blind, tokenizer, prompts, responses, [0, 1, 2, 3], ""))


def test_a_rollout_dump_names_images_by_their_path_or_writes_their_bytes_once():
    import hashlib

    from fsdptrain.rl.metrics import dumped_images

    png, files = picture(0, 8, 8), {}
    names = dumped_images([{"bytes": png, "path": None}, {"bytes": None, "path": "/data/a.jpg"}, "file:///data/b.png", png], files)
    written = f"images/{hashlib.sha1(png).hexdigest()}.png"
    assert names == [written, "/data/a.jpg", "file:///data/b.png", written] and files == {written: png}


def test_the_hf_rollout_samples_image_prompts_from_a_plain_forwards_distribution(vl_folder, tmp_path):
    """Image and text prompts in one batch, n responses each from one prefill: each sampled token's log-prob is a
    plain forward's, and so are the trainer's and a distillation teacher's top-k, from the responses packed after
    their shared prompt."""
    from fsdptrain.rl.agent.loop import SingleTurn
    from fsdptrain.rl.data import load_prompts
    from fsdptrain.rl.rollout.hf import HFRollout
    from fsdptrain.rl.samples import make_samples

    rows = rl_rows(4)
    path = write_rows(tmp_path / "rl.parquet", rows)
    tokenizer = AutoTokenizer.from_pretrained(vl_folder)
    reader = image_reader(vl_folder, "model", "images", tokenizer, AutoConfig.from_pretrained(vl_folder), False)
    prompts = load_prompts([path], tokenizer, images=reader)
    assert [p.images is None for p in prompts] == [False, False, False, True]
    engine = HFRollout(vl_folder, torch.device("cpu"), torch.float32, pad_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    generations = SingleTurn(engine).generate(prompts, n=3, max_new_tokens=10, batch_size=6, calculate_log_probs=True)
    assert len(generations) == 12 and max(len(g.response_ids) for g in generations) > 5
    reference, processor = plain(vl_folder), AutoImageProcessor.from_pretrained(vl_folder)
    expected, expected_top = [], []
    for index, generation in enumerate(generations):
        ids = generation.prompt_ids + generation.response_ids
        logits = plain_logits(reference, processor, ids, rows[index // 3]["images"])
        want = logits[:-1].log_softmax(-1).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)[len(generation.prompt_ids) - 1 :]
        torch.testing.assert_close(torch.tensor(generation.log_probs), want, atol=1e-4, rtol=0, msg=f"rollout: response {index}")
        expected.append(want)
        expected_top.append(logits[len(generation.prompt_ids) - 1 : -1].log_softmax(-1).topk(3, dim=-1))
    samples = make_samples(generations, mask_truncated=False)
    model = as_trained(vl_folder, True, reference)
    batch = collate_packed(samples, share_prefixes=True)
    with torch.no_grad():
        log_probs, _ = token_log_probs(model, batch.inputs, batch.targets["labels"], 1.0, chunk_tokens=16, token_rows=batch.token_rows)
        top_values, top_ids = token_top_k(model, batch.inputs, batch.targets["labels"], 3, chunk_tokens=16, token_rows=batch.token_rows)
    pieces = zip(trained_positions(log_probs.reshape(-1), samples), trained_positions(top_values, samples), trained_positions(top_ids, samples))
    for index, ((got, got_values, got_ids), want, (want_values, want_ids)) in enumerate(zip(pieces, expected, expected_top)):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0, msg=f"trainer: response {index}")
        torch.testing.assert_close(got_values, want_values, atol=1e-4, rtol=0)  # a distillation teacher's top-k, from the same row
        assert torch.equal(got_ids, want_ids), f"top-k: response {index}"


def test_a_critics_values_of_image_prompts_are_its_backbones_plain_forward_through_its_head(vl_folder, tmp_path):
    """A critic of a vision-language model (its tower and decoder, a value head): its values of image and text
    prompts' responses, packed after their shared prompt and padded, equal a plain transformers forward of each
    sequence through the model's own backbone (the causal LM's `model`, loaded from the folder), times the head."""
    from transformers import AutoModelForTokenClassification

    from fsdptrain.rl.critic import token_values
    from fsdptrain.rl.data import load_prompts
    from fsdptrain.rl.rollout.base import Generation
    from fsdptrain.rl.samples import make_samples

    config = AutoConfig.from_pretrained(vl_folder, num_labels=1)
    tokenizer, rows = AutoTokenizer.from_pretrained(vl_folder), rl_rows(4)
    prompts = load_prompts([write_rows(tmp_path / "rl.parquet", rows)], tokenizer,
                           images=image_reader(vl_folder, "model", "images", tokenizer, config, False))
    g = torch.Generator().manual_seed(0)
    generations = [Generation(p.ids, response, [1] * len(response), None, False, images=p.images)
                   for p in prompts for response in (torch.randint(3, 300, (int(torch.randint(2, 9, (), generator=g)),), generator=g).tolist()
                                                     for _ in range(2))]
    samples = make_samples(generations, mask_truncated=False)
    backbone, processor = plain(vl_folder).model, AutoImageProcessor.from_pretrained(vl_folder)
    head = torch.nn.Linear(config.get_text_config().hidden_size, 1)
    expected = []
    for index, sample in enumerate(samples):
        with torch.no_grad():
            hidden = backbone(**plain_inputs(backbone, processor, sample.input_ids.tolist(), rows[index // 2]["images"])).last_hidden_state[0]
        expected.append(head(hidden).squeeze(1)[:-1][sample.loss_mask[1:].bool()])
    for layout, packed, share in (("shared prompt", True, True), ("padded", False, False)):
        critic = build_on_meta(config, LOADING, packed, AutoModelForTokenClassification)
        critic.to_empty(device="cpu")
        critic.load_state_dict({**{f"model.{k}": v for k, v in backbone.state_dict().items()}, "score.weight": head.weight, "score.bias": head.bias})
        for name, buffer in critic.model.named_buffers():
            buffer.copy_(dict(backbone.named_buffers())[name])
        critic.eval()
        batch = collate_packed(samples, share_prefixes=share) if packed else collate_padded(samples, pad_token_id=0)
        with torch.no_grad():
            values = token_values(critic, batch.inputs, batch.targets["labels"], batch.token_rows, None)
        width, start = (None if packed else batch.inputs["input_ids"].shape[1]), 0
        for index, (sample, want) in enumerate(zip(samples, expected)):
            begin = index * width if width else start
            got = values[begin : begin + len(sample) - 1][sample.loss_mask[1:].bool()]
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0, msg=f"{layout}: response {index}")
            start += len(sample)


def test_beams_of_image_prompts_are_transformers_beam_search_with_the_images(vl_folder, tmp_path):
    """The hf engine's beam search (rollout.beam_search) of image and text prompts in one batch: each prompt's beams,
    best first, are transformers' own beam search of that prompt with its images, image tokens banned (its
    `bad_words_ids`: a beam that took one would be read as an image's place)."""
    from fsdptrain.rl.agent.loop import SingleTurn
    from fsdptrain.rl.data import load_prompts
    from fsdptrain.rl.rollout.hf import HFRollout

    rows = rl_rows(4)
    tokenizer = AutoTokenizer.from_pretrained(vl_folder)
    prompts = load_prompts([write_rows(tmp_path / "rl.parquet", rows)], tokenizer,
                           images=image_reader(vl_folder, "model", "images", tokenizer, AutoConfig.from_pretrained(vl_folder), False))
    engine = HFRollout(vl_folder, torch.device("cpu"), torch.float32, pad_id=tokenizer.pad_token_id, beams=True)
    reference, processor = plain(vl_folder), AutoImageProcessor.from_pretrained(vl_folder)
    banned = [i for i in (reference.config.image_token_id, getattr(reference.config, "video_token_id", None)) if i is not None]
    with torch.no_grad():  # end tokens the model is likely to choose early (not image tokens), so that some beams end before the limit
        likely = engine.model(input_ids=torch.tensor([prompts[3].ids])).logits[0, -1].index_fill(0, torch.tensor(banned), -torch.inf)
        likely = likely.topk(3).indices.tolist()
        for model in (engine.model, reference):  # the image token as likely as the likeliest (its embedding is never read: an
            output = model.get_output_embeddings().weight  # image's features take its place): only the ban keeps beams off it
            output[reference.config.image_token_id] = output[likely[0]]
    engine.end_ids = sorted(likely[1:])
    generations = SingleTurn(engine).generate(prompts, n=3, max_new_tokens=6, batch_size=6)
    assert [g.images is not None for g in generations] == [True] * 9 + [False] * 3
    for k, (prompt, row) in enumerate(zip(prompts, rows)):
        output = reference.generate(**plain_inputs(reference, processor, prompt.ids, row["images"]), num_beams=3, num_return_sequences=3, do_sample=False, length_penalty=0.0, early_stopping=True,
                                    max_new_tokens=6, eos_token_id=engine.end_ids, pad_token_id=tokenizer.pad_token_id,
                                    bad_words_ids=[[i] for i in banned])
        expected = []
        for beam in output[:, len(prompt.ids):].tolist():
            end = next((i for i, token in enumerate(beam) if token in engine.end_ids), None)
            expected.append(beam if end is None else beam[: end + 1])
        assert [g.response_ids for g in generations[3 * k : 3 * k + 3]] == expected, k


@pytest.mark.slow
def test_grpo_over_catalog_beams_of_image_prompts(tmp_path):
    """MiniOneRec's beam rollouts (rollout.beam_search over a catalog, the ranking reward, add_gt) with image and text
    prompts through `grpo_trainer` on 2 processes: each group's beams are distinct catalog items, the ground truth
    among them with its prompt's image, and it trains."""
    from test_grpo import grpo_args

    folder = tmp_path / "model"
    make_tiny.tiny_vision_language("qwen2_5_vl", make_tiny.trained_tokenizer(), seed=0, out=str(folder))
    data = tmp_path / "data"
    data.mkdir()
    write_rows(data / "rl_train.parquet", rl_rows(8))
    (data / "catalog.txt").write_text("".join(f"{item}\n" for item in range(4, 40)))  # 36 items: 4 beams mostly miss the answer
    out = str(tmp_path / "run")
    torchrun(2, "fsdptrain.grpo_trainer", grpo_args(
        str(folder), data, out, data__max_prompt_length=256, data__val_files="null", actor_rollout_ref__rollout__beam_search="true",
        actor_rollout_ref__rollout__catalog_file=str(data / "catalog.txt"), custom_reward_function__path="null", actor_rollout_ref__rollout__add_gt="true",
        reward__sources="[{name:ranking,function:item_ranking,weight:1.0}]", trainer__total_training_steps=1,
        trainer__rollout_data_dir=f"{out}/rollouts"))
    (metrics,) = read_metrics(out)
    assert metrics["actor/grad_norm"] > 0
    dumped = [json.loads(line) for line in open(f"{out}/rollouts/1.jsonl")]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert sum("image_grid_thw" in row for row in dumped) == 12
    for first in range(0, len(dumped), 4):
        group = dumped[first : first + 4]
        answers = [tokenizer.decode(row["response_ids"], skip_special_tokens=True) for row in group]
        assert len(set(answers)) == 4 and {int(a) for a in answers} <= set(range(4, 40)) and "4" in answers, answers  # add_gt: the answer 4
        assert len({str(row.get("image_grid_thw")) for row in group}) == 1  # the answer put in a beam's place is trained with the image


def answering_model(folder: str, rows: list[dict], answer: str) -> None:
    """The folder's model fine-tuned in place by a plain torch loop to answer each row's prompt, with its images,
    with `answer` and the end of its turn: a random model rarely ends one."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = plain(folder).train()
    answer_ids = tokenizer(answer + "<|im_end|>", add_special_tokens=False)["input_ids"]
    inputs = []
    for row in rows:
        prompt = reference_inputs(folder, {"messages": row["prompt"], "images": row["images"]}, generation_prompt=True)
        extra = {k: prompt[k] for k in ("pixel_values", "image_grid_thw") if k in prompt}
        inputs.append((torch.cat([prompt["input_ids"][0], torch.tensor(answer_ids)]), prompt["input_ids"].shape[1], extra))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(8):
        for input_ids, length, extra in inputs:
            labels = input_ids.clone()
            labels[:length] = -100
            model(input_ids=input_ids[None], mm_token_type_ids=(input_ids == model.config.image_token_id).int()[None], labels=labels[None],
                  **extra).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    model.save_pretrained(folder)


def test_multi_turn_trajectories_of_image_prompts_read_their_images_every_turn(tmp_path):
    """An environment that answers every assistant turn (verl's interaction) twice: each turn of an image prompt's
    trajectory is sampled from, and trained on, a plain forward's distribution over the whole trajectory with the
    prompt's images (an engine that read them on the first turn only would be off after it), and a re-render of the
    conversation, images as their placeholders, agrees with the trajectory's ids (no drift)."""
    from test_agent import segments

    from fsdptrain.rl.agent.interactions import BaseInteraction
    from fsdptrain.rl.agent.loop import AgentLoop, MultiTurnSettings
    from fsdptrain.rl.data import load_prompts
    from fsdptrain.rl.rollout.hf import HFRollout
    from fsdptrain.rl.samples import make_samples

    class LookAgain(BaseInteraction):
        async def generate_response(self, instance_id, messages, **kwargs):
            return False, "Look again.", 0.0, {}

    folder = str(tmp_path / "model")
    make_tiny.tiny_vision_language("qwen2_5_vl", make_tiny.trained_tokenizer(), seed=0, out=folder)
    rows = [{**row, "extra_info": {"interaction_kwargs": {"name": "look"}}} for row in rl_rows(4)]
    answering_model(folder, rows, "4")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    reader = image_reader(folder, "model", "images", tokenizer, AutoConfig.from_pretrained(folder), False)
    prompts = load_prompts([write_rows(tmp_path / "rl.parquet", rows)], tokenizer, images=reader)
    settings = MultiTurnSettings(max_assistant_turns=None, max_user_turns=2, max_parallel_calls=1, max_tool_response_length=256,
                                 tool_response_truncate_side="middle", format="hermes", tokenization_sanity_check_mode="strict", tool_timeout_s=5.0)
    engine = HFRollout(folder, torch.device("cpu"), torch.float32, pad_id=tokenizer.pad_token_id)
    loop = AgentLoop(engine, tokenizer, settings, {}, {"look": LookAgain({"name": "look"})}, images=reader)
    torch.manual_seed(0)
    generations = loop.generate(prompts, n=2, max_new_tokens=120, batch_size=8, calculate_log_probs=True)
    finished = [g for g in generations if g.trace.assistant_turns == 3 and not g.truncated]
    assert len(finished) >= 4 and any(g.images is not None for g in finished), [g.trace.assistant_turns for g in generations]
    for g in finished:  # drift where, and only where, a sampled turn is not the tokenization of its own text
        turns = [m["content"] for m in g.trace.messages if m["trained"]]
        runs = [ids for trained, ids in segments(g) if trained]
        canonical = all(tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.convert_tokens_to_ids("<|im_end|>")] == ids
                        for text, ids in zip(turns, runs, strict=True))
        assert g.trace.drift is (not canonical), turns
    reference, processor = plain(folder), AutoImageProcessor.from_pretrained(folder)
    expected = []
    for index, generation in enumerate(generations):
        ids = generation.prompt_ids + generation.response_ids
        logits = plain_logits(reference, processor, ids, rows[index // 2]["images"])
        want = logits[:-1].log_softmax(-1).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)[len(generation.prompt_ids) - 1 :]
        trained = torch.tensor(generation.response_mask, dtype=torch.bool)
        torch.testing.assert_close(torch.tensor(generation.log_probs)[trained], want[trained], atol=1e-4, rtol=0, msg=f"rollout: {index}")
        expected.append(want[trained])
    samples = make_samples(generations, mask_truncated=False)
    model = as_trained(folder, True, reference)
    batch = collate_packed(samples, share_prefixes=True)
    with torch.no_grad():
        log_probs, _ = token_log_probs(model, batch.inputs, batch.targets["labels"], 1.0, chunk_tokens=16, token_rows=batch.token_rows)
    for index, (got, want) in enumerate(zip(trained_positions(log_probs.reshape(-1), samples), expected)):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0, msg=f"trainer: response {index}")


@pytest.mark.slow
def test_a_multi_turn_grpo_run_with_image_prompts_trains_through_an_environment(tmp_path):
    """`grpo_trainer` with multi_turn.enable and verl's interaction YAML (the built-in sokoban environment answering
    each turn) on image and text prompts, 2 processes: trajectories of several turns, with their images, train."""
    import yaml

    from test_grpo import grpo_args

    folder = str(tmp_path / "model")
    make_tiny.tiny_vision_language("qwen2_5_vl", make_tiny.trained_tokenizer(), seed=0, out=folder)
    rows = [{**row, "extra_info": {"interaction_kwargs": {"name": "sokoban", "seed": i}}} for i, row in enumerate(rl_rows(8))]
    answering_model(folder, rows, "4")
    data = tmp_path / "data"
    data.mkdir()
    write_rows(data / "rl_train.parquet", rows)
    (data / "reward.py").write_text(RL_REWARD)
    (data / "interaction.yaml").write_text(yaml.safe_dump({"interaction": [{
        "name": "sokoban", "class_name": "fsdptrain.rl.agent.interactions.EnvironmentInteraction",
        "config": {"env": "fsdptrain.rl.agent.sokoban.Sokoban", "max_steps": 2, "env_config": {"size": 5, "boxes": 1}}}]}))
    out = str(tmp_path / "run")
    torchrun(2, "fsdptrain.grpo_trainer", grpo_args(
        folder, data, out, data__max_prompt_length=256, data__max_response_length=240, data__val_files="null",
        actor_rollout_ref__rollout__multi_turn__enable="true", actor_rollout_ref__rollout__multi_turn__interaction_config_path=str(data / "interaction.yaml"),
        trainer__total_training_steps=1, trainer__rollout_data_dir=f"{out}/rollouts"))
    (metrics,) = read_metrics(out)
    assert metrics["actor/grad_norm"] > 0
    dumped = [json.loads(line) for line in open(f"{out}/rollouts/1.jsonl")]
    with_images = [row for row in dumped if "image_grid_thw" in row]
    assert len(with_images) == 12 and any(sum(turn["role"] == "user" for turn in row["turns"]) >= 1 for row in with_images)


@pytest.mark.slow
def test_grpo_trains_on_image_and_text_prompts_on_2_processes_and_resumes_exactly(tmp_path):
    from test_grpo import grpo_args

    folder, data = rl_run_files(tmp_path, rl_rows(16))
    write_rows(data / "rl_val.parquet", rl_rows(4))
    (data / "reward.py").write_text(RL_REWARD + "\n\ndef seeing(data_source, solution_str, ground_truth, extra_info=None, images=None):\n"
                                    "    return {**compute_score(data_source, solution_str, ground_truth), 'image_count': float(len(images))}\n")
    common = dict(data__max_prompt_length=256, actor_rollout_ref__model__fsdp_config__model_dtype="fp32", actor_rollout_ref__actor__use_kl_loss="true",
                  trainer__save_freq=1, trainer__checkpoint__save_contents="[model,optimizer,extra,hf_model]", custom_reward_function__name="seeing")
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    torchrun(2, "fsdptrain.grpo_trainer", grpo_args(str(folder), data, straight, **common, trainer__rollout_data_dir=f"{straight}/rollouts"))
    dumped = [json.loads(line) for line in open(f"{straight}/rollouts/1.jsonl")]
    assert len(dumped) == 16 and sum("image_grid_thw" in row for row in dumped) == 12  # every fourth prompt is text only
    assert [row["image_count"] for row in dumped] == [len(row.get("image_grid_thw", [])) for row in dumped]  # the reward saw them
    pictures, processor = {image["bytes"] for row in rl_rows(16) for image in row["images"]}, AutoImageProcessor.from_pretrained(folder)
    for row in dumped:  # each prompt's images, written beside the dump as the rows hold them, of the row's patch grids
        files = [(Path(straight) / "rollouts" / name).read_bytes() for name in row.get("images", [])]
        assert len(files) == len(row.get("image_grid_thw", [])) and all(data in pictures for data in files)
        if files:
            grids = processor(images=[Image.open(io.BytesIO(data)).convert("RGB") for data in files], return_tensors="pt")["image_grid_thw"]
            assert grids.tolist() == row["image_grid_thw"]
    metrics = read_metrics(straight)
    assert [m["step"] for m in metrics] == [1, 2] and metrics[-1]["prompt_length/max"] > 30  # image tokens in the prompts
    assert "val-core/shapes/acc/mean@1" in metrics[-1] or any(k.startswith("val-core/") for k in metrics[-1])
    torchrun(2, "fsdptrain.grpo_trainer", grpo_args(str(folder), data, resumed, **{**common, "trainer__total_training_steps": 1}))
    torchrun(2, "fsdptrain.grpo_trainer", grpo_args(str(folder), data, resumed, **common))
    again = read_metrics(resumed)
    for key in ("critic/score/mean", "actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/grad_norm"):
        assert again[1][key] == pytest.approx(metrics[1][key], rel=1e-5, abs=1e-7), key
    assert_same_weights(hf_weights(f"{resumed}/global_step_2"), hf_weights(f"{straight}/global_step_2"), atol=1e-6)


@pytest.mark.slow
def test_ppo_with_a_vision_language_critic_trains_on_image_and_text_prompts_and_resumes_exactly(tmp_path):
    """PPO (GAE) whose critic is the vision-language policy's folder with a value head, on 2 processes with image and
    text prompts: the critic trains from the first step (critic_warmup) and a resumed run equals the straight one."""
    from test_ppo import PPO

    from test_grpo import grpo_args

    folder, data = rl_run_files(tmp_path, rl_rows(16))
    common = dict(PPO, data__max_prompt_length=256, data__val_files="null", actor_rollout_ref__model__fsdp_config__model_dtype="fp32",
                  critic__model__fsdp_config__model_dtype="fp32", trainer__save_freq=1)
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    torchrun(2, "fsdptrain.grpo_trainer", grpo_args(str(folder), data, straight, **common))
    metrics = read_metrics(straight)
    assert [m["step"] for m in metrics] == [1, 2] and metrics[0]["prompt_length/max"] > 30
    assert all(m["critic/grad_norm"] > 0 for m in metrics) and "actor/pg_loss" in metrics[1]
    torchrun(2, "fsdptrain.grpo_trainer", grpo_args(str(folder), data, resumed, **{**common, "trainer__total_training_steps": 1}))
    torchrun(2, "fsdptrain.grpo_trainer", grpo_args(str(folder), data, resumed, **common))
    again = read_metrics(resumed)
    for key in ("critic/values/mean", "critic/vf_loss", "critic/grad_norm", "critic/vf_explained_var", "actor/pg_loss", "actor/grad_norm"):
        assert again[1][key] == pytest.approx(metrics[1][key], rel=1e-5, abs=1e-7), key


@pytest.mark.slow
def test_a_vision_language_reward_model_scores_each_response_with_its_prompts_images(tmp_path, capsys):
    """A reward model of the policy's type (its backbone and a score head, saved as transformers saves it) on 2
    processes, packed, with image and text prompts: each response's score is a plain forward of the folder's
    backbone with the row's images, through the head's weights read from the folder, at its last token; one whose
    tokenizer is not the policy's is refused (its own template would not carry the images)."""
    from safetensors.torch import load_file as load_weights
    from transformers import AutoModelForTokenClassification

    from fsdptrain.check import main as check_main
    from fsdptrain.models.vision import model_class

    from test_grpo import grpo_args

    folder, reward_model = tmp_path / "model", tmp_path / "rm"
    make_tiny.tiny_vision_language("qwen2_5_vl", make_tiny.trained_tokenizer(), seed=0, out=str(folder))
    make_tiny.tiny_vision_language("qwen2_5_vl", make_tiny.trained_tokenizer(), seed=3, out=str(reward_model))
    config = AutoConfig.from_pretrained(reward_model, num_labels=1)
    scorer = model_class(config, AutoModelForTokenClassification).from_pretrained(str(reward_model), config=config, dtype=torch.float32)
    torch.nn.init.normal_(scorer.score.weight, std=1.0)  # scores that differ from response to response
    scorer.save_pretrained(reward_model)
    rows = [{**row, "prompt": [{"role": "user", "content": f"{row['prompt'][0]['content']} (row {i})"}]} for i, row in enumerate(rl_rows(8))]
    data = tmp_path / "data"
    data.mkdir()
    write_rows(data / "rl_train.parquet", rows)
    out = str(tmp_path / "run")
    settings = dict(data__max_prompt_length=256, data__val_files="null", custom_reward_function__path="null", reward_model__enable="true",
                    reward_model__model__path=str(reward_model), reward_model__micro_batch_size_per_gpu=3, trainer__total_training_steps=1)
    torchrun(2, "fsdptrain.grpo_trainer", grpo_args(str(folder), data, out, **settings, trainer__rollout_data_dir=f"{out}/rollouts"))
    backbone = AutoModelForImageTextToText.from_pretrained(reward_model, dtype=torch.float32).model.eval()
    head = load_weights(str(reward_model / "model.safetensors"))
    processor = AutoImageProcessor.from_pretrained(reward_model)
    dumped = [json.loads(line) for line in open(f"{out}/rollouts/1.jsonl")]
    assert len(dumped) == 16 and sum("image_grid_thw" in row for row in dumped) == 12
    expected = []
    for row in dumped:
        images = rows[int(row["prompt"][0]["content"].rsplit("(row ", 1)[1].rstrip(")"))]["images"]
        with torch.no_grad():
            last = backbone(**plain_inputs(backbone, processor, row["prompt_ids"] + row["response_ids"], images)).last_hidden_state[0, -1]
        expected.append(float(last @ head["score.weight"][0] + head["score.bias"][0]))
    assert [row["source/reward_model"] for row in dumped] == pytest.approx(expected, abs=1e-4)
    assert len({round(value, 3) for value in expected}) > 8
    other = make_tiny.trained_tokenizer()
    other.chat_template = other.chat_template.replace("<|im_start|>", "<|im_start|> ")
    other.save_pretrained(reward_model)
    args = grpo_args(str(folder), data, str(tmp_path / "refused"), **settings)
    assert check_main(["grpo", "--nproc-per-node", "2", "--device", "cpu", *args]) == 1
    said = capsys.readouterr().err
    assert f"reward_model.model.path={str(reward_model)!r} has another tokenizer or chat template" in said, said


@pytest.mark.slow
def test_the_asynchronous_modes_with_nothing_in_flight_train_image_prompts_as_the_synchronous_run(tmp_path):
    """Image and text prompts, fp32: standalone rollout ranks at lag 0 (2 training + 2 rollout ranks, separate_async)
    and colocate_async with no batch in flight ahead (2 ranks) each give the synchronous run on 2 ranks: the same
    responses, scores, losses and gradient norms, step by step."""
    from test_async import SEPARATE, dumped

    from test_grpo import grpo_args

    folder, data = rl_run_files(tmp_path, rl_rows(16))
    common = dict(data__max_prompt_length=256, data__val_files="null", actor_rollout_ref__model__fsdp_config__model_dtype="fp32")
    runs = {"sync": (2, {}), "separate": (4, {**SEPARATE, "actor_rollout_ref__rollout__n_gpus_per_node": 2,
                                               "trainer__v1__separate_async__parameter_sync_step": 1,
                                               "trainer__v1__sampler__max_off_policy_threshold": 0, "trainer__v1__sampler__max_off_policy_strategy": "wait"}),
            "colocate": (2, {"trainer__v1__trainer_mode": "colocate_async", "trainer__v1__colocate_async__num_warmup_batches": 0})}
    metrics = {}
    for name, (processes, mode) in runs.items():
        out = str(tmp_path / name)
        torchrun(processes, "fsdptrain.grpo_trainer", grpo_args(str(folder), data, out, **common, **mode, trainer__rollout_data_dir=f"{out}/rollouts"))
        metrics[name] = read_metrics(out)
    assert sum("image_grid_thw" in row for row in dumped(str(tmp_path / "sync"))[1]) == 12
    for name in ("separate", "colocate"):
        for key in ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "response_length/mean"):
            assert [m[key] for m in metrics[name]] == pytest.approx([m[key] for m in metrics["sync"]], rel=1e-6, abs=1e-7), (name, key)
        for step, rows in dumped(str(tmp_path / name)).items():
            assert [r["response_ids"] for r in rows] == [r["response_ids"] for r in dumped(str(tmp_path / "sync"))[step]], (name, step)


@pytest.mark.slow
def test_lora_grpo_of_a_vision_language_model_adapts_its_decoder_and_samples_from_the_merged_weights(tmp_path):
    """LoRA (all-linear, verl's default) on a vision-language policy, 2 processes, image and text prompts, the KL to
    the adapters-off reference: the adapters go on the language decoder (the vision tower stays as loaded: its
    merger is in no sharded layer), the engine samples from the merged weights (its log-probs are the trainer's),
    and peft's own merge of the saved adapter into the pretrained model is the run's export."""
    from peft import PeftModel

    from test_grpo import grpo_args

    folder, data = rl_run_files(tmp_path, rl_rows(8))
    out = str(tmp_path / "run")
    torchrun(2, "fsdptrain.grpo_trainer", grpo_args(
        str(folder), data, out, data__max_prompt_length=256, data__val_files="null", actor_rollout_ref__model__lora_rank=4,
        actor_rollout_ref__model__lora_alpha=8, actor_rollout_ref__actor__optim__lr="1e-2", actor_rollout_ref__actor__use_kl_loss="true",
        actor_rollout_ref__rollout__calculate_log_probs="true", trainer__save_freq=2,
        trainer__checkpoint__save_contents="[model,optimizer,extra,hf_model,lora_adapter]"))
    metrics = read_metrics(out)
    assert all(m["training/rollout_probs_diff_max"] < 1e-4 for m in metrics) and metrics[1]["actor/kl_loss"] > 1e-6
    adapter = f"{out}/global_step_2/lora_adapter"
    names = list(load_file(f"{adapter}/adapter_model.safetensors"))
    assert any(".language_model." in name for name in names) and not any(".visual." in name for name in names)
    base = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    merged = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32), adapter).merge_and_unload()
    exported = AutoModelForImageTextToText.from_pretrained(f"{out}/global_step_2/huggingface", dtype=torch.float32)
    assert_same_weights(exported.state_dict(), merged.state_dict(), atol=1e-6)
    pretrained = base.state_dict()
    moved = {name for name, tensor in exported.state_dict().items() if not torch.equal(tensor, pretrained[name])}
    assert moved and all(".language_model." in name for name in moved), sorted(moved)


@pytest.mark.slow
def test_a_distillation_teacher_reads_the_policys_images(tmp_path, capsys):
    """On-policy distillation of a vision-language policy on 2 processes with image and text prompts: a teacher that
    is the policy's own folder gives a first step's top-k forward KL of 0 (a teacher shown other images, or none,
    would not); a teacher of another architecture, which would read the images otherwise, is refused by check."""
    from fsdptrain.check import main as check_main

    from test_grpo import grpo_args

    folder, data = rl_run_files(tmp_path, rl_rows(8))
    write_rows(data / "rl_val.parquet", rl_rows(4))
    out = str(tmp_path / "run")
    distilling = dict(data__max_prompt_length=256, actor_rollout_ref__model__fsdp_config__model_dtype="fp32", distillation__enabled="true",
                      distillation__teacher_models__teacher_model__model_path=str(folder), distillation__distillation_loss__loss_mode="forward_kl_topk",
                      trainer__total_training_steps=1, trainer__test_freq=-1)
    torchrun(2, "fsdptrain.grpo_trainer", grpo_args(str(folder), data, out, **distilling))
    (step,) = read_metrics(out)
    assert step["prompt_length/max"] > 30 and step["actor/distillation/student_mass"] > 0.1  # image prompts, top-k mass to compare
    assert abs(step["actor/distillation/loss"]) < 1e-5, step["actor/distillation/loss"]
    other = tmp_path / "qwen3_vl"
    make_tiny.tiny_vision_language("qwen3_vl", make_tiny.trained_tokenizer(), seed=0, out=str(other))
    args = grpo_args(str(folder), data, str(tmp_path / "refused"), **{**distilling, "distillation__teacher_models__teacher_model__model_path": str(other)})
    assert check_main(["grpo", "--nproc-per-node", "2", "--device", "cpu", *args]) == 1
    said = capsys.readouterr().err
    assert f"distillation.teacher_models.teacher_model.model_path={str(other)!r} (qwen3_vl) does not read images as" in said, said


def test_a_response_that_draws_an_image_token_ends_before_it(tmp_path):
    """An image token in a response would be taken for an image's place by every later forward: the hf engine ends
    the response before it (cut short), its tokens before it as drawn."""
    from fsdptrain.rl.advantages import outcome_rewards
    from fsdptrain.rl.rollout.hf import HFRollout
    from fsdptrain.rl.samples import make_samples

    folder = tmp_path / "model"
    make_tiny.tiny_vision_language("qwen2_5_vl", make_tiny.trained_tokenizer(), seed=0, out=str(folder))
    engine = HFRollout(str(folder), torch.device("cpu"), torch.float32, pad_id=0)
    assert engine.placeholder_ids == [engine.model.config.image_token_id, engine.model.config.video_token_id]
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    torch.manual_seed(0)
    free = engine.generate(prompts, n=2, max_new_tokens=12, batch_size=4)
    row, place = next((r, k) for r, g in enumerate(free) for k in range(1, len(g.response_ids)) if g.response_ids[k] not in g.response_ids[:k])
    engine.placeholder_ids = [free[row].response_ids[place]]  # as if that token were the image's
    torch.manual_seed(0)
    cut = engine.generate(prompts, n=2, max_new_tokens=12, batch_size=4)
    assert cut[row].response_ids == free[row].response_ids[:place] and cut[row].truncated
    assert all(engine.placeholder_ids[0] not in g.response_ids for g in cut)
    # drawn first: an empty response, cut short, which trains nothing and whose score lands on no token
    engine.placeholder_ids = [free[0].response_ids[0]]
    torch.manual_seed(0)
    empty = engine.generate(prompts, n=2, max_new_tokens=12, batch_size=4)[0]
    assert empty.response_ids == [] and empty.truncated
    (sample,) = make_samples([empty], mask_truncated=False)
    assert sample.input_ids.tolist() == prompts[0] and int(sample.loss_mask.sum()) == 0
    assert outcome_rewards(torch.tensor([1.0]), [empty])[0].numel() == 0


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_a_grpo_mini_batch_gradient_with_images_is_the_same_whatever_the_layout(tmp_path, arch):
    """Groups of image and text prompts, the policy's gradient and its critic's (the same model with a value head):
    one process with micro-batches of 8 packed sequences (each prompt with its image held once for its responses),
    two with micro-batches of 1 padded sequence, two at the defaults, and one Ulysses group of two, each rank a
    slice of every row (Qwen3-VL's deepstack features cut with it)."""
    from tests.checks.common import relative_gap

    folder = tmp_path / "model"
    make_tiny.tiny_vision_language(arch, make_tiny.trained_tokenizer(), seed=0, out=str(folder))
    data = write_rows(tmp_path / "rl.parquet", rl_rows(4))
    gradients = {}
    for name, (nproc, micro, packed, sp) in {"dp1-micro8-packed": (1, 8, "true", 1), "dp2-micro1-padded": (2, 1, "false", 1),
                                             "dp2-defaults": (2, "default", "true", 1), "sp2-micro3-packed": (2, 3, "true", 2)}.items():
        out = str(tmp_path / f"{name}.pt")
        torchrun(nproc, "tests.checks.vision_check", [str(folder), data, out, str(micro), packed, str(sp)])
        gradients[name] = torch.load(out)
    reference = gradients.pop("dp1-micro8-packed")
    for model in ("actor", "critic"):
        assert any(name.startswith("model.visual.") and float(grad.abs().max()) > 0 for name, grad in reference[model].items()), model
        for layout, gradient in gradients.items():
            assert relative_gap(gradient[model], reference[model]) < 2e-5, (model, layout)


# ---- verl's vision-language examples as written ----------------------------------------------------------------------
VL_EXAMPLES = {"grpo_trainer/run_qwen2_5_vl_7b_fsdp.sh": "qwen2_5_vl", "grpo_trainer/run_qwen3_vl_8b_fsdp.sh": "qwen3_vl",
               "grpo_trainer/run_qwen3_vl_30b_a3b_fsdp.sh": "qwen3_vl_moe", "grpo_trainer/run_glm4_1v_9b_fsdp.sh": "glm4v",
               "sft/vlm/run_qwen3_vl_2b_fsdp.sh": "qwen3_vl"}


def geo3k_rows(count: int) -> list[dict]:
    """verl's geo3k preprocessing's layout (the VL examples' data): one image a problem, `<image>` first."""
    return [{**row, "data_source": "hiyouga/geometry3k", "images": row["images"][:1],
             "prompt": [{"role": "user", "content": "<image>" * len(row["images"][:1]) + "What is 2 + 2? Put the answer in \\boxed{}."}]}
            for row in rl_rows(count)]


@pytest.mark.slow
@pytest.mark.parametrize("script", VL_EXAMPLES, ids=lambda s: s.rsplit("/", 1)[-1])
def test_verls_vision_language_examples_train_a_step(tmp_path, script, capsys):
    """verl 0.9.0's vision-language examples (Qwen2.5-VL, Qwen3-VL dense and MoE with Ulysses and rollout correction,
    GLM-4.1V; SFT of Qwen3-VL with Ulysses) as bash computes them, a tiny model of each one's own architecture and
    data in its layout, on 2 CPU processes with the launcher, paths, model and sizes changed. As written they roll
    out with vLLM, whose multimodal path needs torchvision (not importable against the CPU torch here): check
    refuses that by name; with actor_rollout_ref.rollout.name=hf check passes and a step trains."""
    from launch_arguments import launch_arguments

    from fsdptrain.check import main as check_main

    from test_verl_keys import EXAMPLE_SIZES, SCRIPT_ENV, V09_EXAMPLES, console_steps, sizes_and_paths, with_local

    folder, out = tmp_path / "model", str(tmp_path / "run")
    make_tiny.tiny_vision_language(VL_EXAMPLES[script], make_tiny.trained_tokenizer(), seed=0, out=str(folder))
    data = tmp_path / "data"
    data.mkdir()
    if script.startswith("sft/"):
        paths = {"data.train_files": write_rows(data / "train.parquet", chats() * 4), "data.val_files": write_rows(data / "val.parquet", chats()),
                 "model.path": folder, "data.train_batch_size": 8, "data.micro_batch_size_per_gpu": 2, "data.max_length": 512,
                 "data.max_token_len_per_gpu": 1024, "trainer.total_training_steps": 1, "trainer.device": "cpu", "trainer.logger": "[console]",
                 "trainer.default_local_dir": out}
        _, args = launch_arguments(V09_EXAMPLES / script, "2", out, env=SCRIPT_ENV)
        args = with_local(args, paths)
        assert check_main(["sft", "--nproc-per-node", "2", "--device", "cpu", *args]) == 0
        result = torchrun(2, "fsdptrain.sft_trainer", args)
        assert [int(step) for step, _ in console_steps(result.stdout)] == [1], result.stdout[-3000:]
        return
    write_rows(data / "rl_train.parquet", geo3k_rows(8))
    write_rows(data / "rl_val.parquet", geo3k_rows(4))
    _, args = launch_arguments(V09_EXAMPLES / script, env=SCRIPT_ENV)
    args = with_local(args, {**sizes_and_paths(str(folder), data, out), **EXAMPLE_SIZES, "trainer.total_training_steps": 1, "trainer.test_freq": 1,
                             "data.max_prompt_length": 256, "actor_rollout_ref.actor.fsdp_config.fsdp_size": -1,
                             "actor_rollout_ref.ref.fsdp_config.fsdp_size": -1})
    assert check_main(["grpo", "--nproc-per-node", "2", "--device", "cpu", *args]) == 1
    assert "its images do not reach actor_rollout_ref.rollout.name=vllm" in capsys.readouterr().err
    args = with_local(args, {"actor_rollout_ref.rollout.name": "hf"})
    assert check_main(["grpo", "--nproc-per-node", "2", "--device", "cpu", *args]) == 0
    result = torchrun(2, "fsdptrain.grpo_trainer", args)
    lines = [(step, line) for step, line in console_steps(result.stdout) if step != "0"]  # step 0: validation before training
    assert [int(step) for step, _ in lines] == [1], result.stdout[-3000:]
    assert "critic/score/mean" in lines[0][1] and "actor/pg_loss" in lines[0][1]


def test_the_evaluation_reads_a_vision_language_models_images(tmp_path, capsys):
    """`python -m fsdptrain.evaluate` on a vision-language folder and RL rows with images (the hf backend); vLLM
    refused by name."""
    from fsdptrain.evaluate import main as evaluate_main

    folder = tmp_path / "model"
    make_tiny.tiny_vision_language("qwen2_5_vl", make_tiny.trained_tokenizer(), seed=0, out=str(folder))
    data = write_rows(tmp_path / "rl.parquet", geo3k_rows(4))
    evaluate_main([str(folder), data, "--max-new-tokens", "4", "--out", str(tmp_path / "out.jsonl")])
    records = [json.loads(line) for line in open(tmp_path / "out.jsonl")]
    assert len(records) == 4 and "hiyouga/geometry3k" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="vision-language model .* read by the hf backend"):
        evaluate_main([str(folder), data, "--backend", "vllm"])


def test_the_shape_data_is_verls_layout_and_its_reward_reads_the_first_colour(tmp_path):
    """scripts/make_shape_data.py: SFT and RL files a vision-language model reads, answers only in the image, test
    images not among the training ones, and its reward function."""
    import subprocess
    import sys

    from fsdptrain.rl.data import load_prompts
    from fsdptrain.rl.rewards import load_reward_function

    subprocess.run([sys.executable, "scripts/make_shape_data.py", str(tmp_path / "data"), "--train", "12", "--test", "6"], check=True,
                   capture_output=True, cwd=Path(__file__).resolve().parents[1])
    folder = tmp_path / "model"
    make_tiny.tiny_vision_language("qwen2_5_vl", make_tiny.trained_tokenizer(), seed=0, out=str(folder))
    samples = sft_data(str(folder), tmp_path / "data" / "sft_train.parquet")
    assert len(samples) == 12 and all(s.images is not None for s in samples)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    reader = image_reader(str(folder), "model", "images", tokenizer, AutoConfig.from_pretrained(folder), False)
    train, test = (load_prompts([str(tmp_path / "data" / f"{name}.parquet")], tokenizer, images=reader) for name in ("rl_train", "rl_test"))
    assert len(train) == 12 and len(test) == 6
    train_pixels = [p.images.inputs["pixel_values"] for p in train]
    assert not any(torch.equal(p.images.inputs["pixel_values"], q) for p in test for q in train_pixels)
    score = load_reward_function(str(tmp_path / "data" / "reward.py"), None)
    assert score("shape_colour", "red, or blue", "red", None)["acc"] == 1.0 and score("shape_colour", "blue red", "red", None)["acc"] == 0.0
