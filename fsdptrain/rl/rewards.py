"""Reward functions: rule scores chosen by a sample's data_source (as verl's default), or a user's function.

Every reward function has verl's signature, `compute_score(data_source, solution_str, ground_truth, extra_info)`,
and returns a float or a dict with a `score` key (an `acc` key, where given, is the sample's accuracy; other keys
are logged). A function with a parameter named `images` (TRL's name) is also given the row's images, as RGB PIL
images in the order of its `<image>` marks (none for a text row). The GRPO trainer's validation and
`python -m fsdptrain.evaluate` call the same functions.
"""

import functools
import importlib.util
import inspect
import math
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from PIL import Image
from transformers import PreTrainedTokenizerBase

from fsdptrain.data.images import open_image
from fsdptrain.errors import UserError
from fsdptrain.registry import Registry
from fsdptrain.rl.data import Prompt
from fsdptrain.rl.rollout.base import Generation, members

RewardFn = Callable[[str, str, Any, dict | None], float | dict]
# Built-in verifiers, by the name a reward source gives as its `function`; each has verl's signature.
VERIFIERS: Registry[RewardFn] = Registry("built-in verifier")

GSM8K_SOURCES = ("openai/gsm8k", "gsm8k", "arithmetic")
MATH_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500", "math")
GEO3K_SOURCES = ("hiyouga/geometry3k",)  # the vision-language examples' data (verl's geo3k preprocessing)


class RewardError(UserError, RuntimeError):
    """A reward function that cannot be loaded or that failed on a sample; the message names it."""


def _number(text: str) -> str:
    return text.replace(",", "").replace("$", "").rstrip(".")


def extract_gsm8k_answer(solution: str, method: str = "strict") -> str | None:
    """The final answer of a GSM8K-style solution: strict, the number after the last `#### `; flexible, the last
    number anywhere. Only the last 300 characters are read, as verl does, so that a long response cannot hide an
    answer in its middle."""
    tail = solution[-300:]
    if method == "strict":
        found = re.findall(r"#### (\-?[0-9\.\,]+)", tail)
        return _number(found[-1]) if found else None
    numbers = [n for n in re.findall(r"(\-?[0-9\.\,]+)", tail) if n not in ("", ".", ",")]
    return _number(numbers[-1]) if numbers else None


def gsm8k_score(solution: str, ground_truth: str, method: str = "strict", format_score: float = 0.0) -> float:
    """1 for the right final answer, `format_score` for a wrong one, 0 for none."""
    answer = extract_gsm8k_answer(solution, method)
    if answer is None:
        return 0.0
    return 1.0 if answer == _number(str(ground_truth)) else format_score


def last_boxed(solution: str) -> str | None:
    """The content of the last `\\boxed{...}` (braces matched), or None."""
    start = solution.rfind("\\boxed")
    if start < 0:
        return None
    open_brace = solution.find("{", start)
    if open_brace < 0:
        return None
    depth = 0
    for i in range(open_brace, len(solution)):
        depth += {"{": 1, "}": -1}.get(solution[i], 0)
        if depth == 0:
            return solution[open_brace + 1 : i]
    return None


def normalize_math(answer: str) -> str:
    """A light normalization of a LaTeX answer: spacing, sizing commands, dollar signs, \\dfrac/\\tfrac, a
    trailing period, `x = ` before the value and a trailing `.0` of an integer."""
    text = answer.strip()
    for old, new in (("\\left", ""), ("\\right", ""), ("\\!", ""), ("\\,", ""), ("\\;", ""), ("$", ""), ("dfrac", "frac"),
                     ("tfrac", "frac"), ("^\\circ", ""), ("^{\\circ}", ""), ("\\%", ""), (" ", "")):
        text = text.replace(old, new)
    text = re.sub(r"^[a-zA-Z]=", "", text).rstrip(".")
    if re.fullmatch(r"-?\d+\.0+", text):
        text = text.split(".")[0]
    return text


def geo3k_score(solution: str, ground_truth: str, format_score: float = 0.1) -> float:
    """verl's geo3k rule: 0.9 for the last `\\boxed{}` answer, 0.1 for the `<think>...</think>...\\boxed{...}`
    format. The answer is compared as math_score compares it (verl grades with mathruler, which also takes
    equivalent expressions)."""
    form = re.fullmatch(r"<think>.*</think>.*\\boxed\{.*\}.*", solution, flags=re.DOTALL) is not None
    return (1.0 - format_score) * math_score(solution, ground_truth) + format_score * float(form)


def math_score(solution: str, ground_truth: str) -> float:
    answer = last_boxed(solution)
    if answer is None:
        return 0.0
    truth = last_boxed(ground_truth) if "\\boxed" in str(ground_truth) else str(ground_truth)
    return 1.0 if truth is not None and normalize_math(answer) == normalize_math(truth) else 0.0


@VERIFIERS.register("rules")
def default_compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """verl's default choice of rule by data source: GSM8K-style `#### answer` (strict), MATH-style `\\boxed{}`."""
    if data_source in GSM8K_SOURCES:
        return gsm8k_score(solution_str, ground_truth)
    if data_source in GEO3K_SOURCES:
        return geo3k_score(solution_str, ground_truth)
    if data_source in MATH_SOURCES or "math" in data_source.lower():
        return math_score(solution_str, ground_truth)
    raise RewardError(
        f"no built-in reward for data_source {data_source!r} (built in: {', '.join(GSM8K_SOURCES + GEO3K_SOURCES + MATH_SOURCES)}); "
        "give custom_reward_function.path and .name"
    )


def strict_format_score(solution: str) -> float:
    """1 where the response ends with its answer as `#### <number>` (GSM8K's format), else 0."""
    return float(re.search(r"#### -?[0-9][0-9,]*(\.[0-9]+)?\s*$", solution) is not None)


@VERIFIERS.register("gsm8k")
def gsm8k_verifier(data_source: str, solution: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    return gsm8k_score(solution, ground_truth)


@VERIFIERS.register("gsm8k_flexible")
def gsm8k_flexible_verifier(data_source: str, solution: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    return gsm8k_score(solution, ground_truth, "flexible")


@VERIFIERS.register("math")
def math_verifier(data_source: str, solution: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    return math_score(solution, ground_truth)


@VERIFIERS.register("strict_format")
def strict_format_verifier(data_source: str, solution: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    return strict_format_score(solution)


@VERIFIERS.register("turn_scores")
def turn_scores_verifier(data_source: str, solution: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """The sum of an interaction's per-reply scores (multi-turn)."""
    return float(sum((extra_info or {}).get("turn_scores", ())))


def item_text(text: str) -> str:
    """An item as MiniOneRec compares it: quotes, newlines and spaces removed."""
    return re.sub(r"[\s\"']", "", text)


@VERIFIERS.register("item_rule")
def item_rule_verifier(data_source: str, solution: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """MiniOneRec's `rule`: 1 for the target item (the row's ground truth), else 0."""
    return float(item_text(solution) == item_text(str(ground_truth)))


@VERIFIERS.register("item_ranking")
def item_ranking_verifier(data_source: str, solution: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """MiniOneRec's `ranking`: `rule` plus, in a group that holds the target, -w_k / sum_j w_j for a wrong response
    of beam rank k (w_k = 1 / log2(k + 2), over the group's G ranks); 0 beside the target in a group without it.
    Reads the group from extra_info (`group_responses`, `group_rank`: beam search gives them best first)."""
    info = extra_info or {}
    target, group = item_text(str(ground_truth)), [item_text(r) for r in info.get("group_responses", [solution])]
    rank = info.get("group_rank", 0)
    if item_text(solution) == target:
        return 1.0
    if target not in group:
        return 0.0
    weights = [1 / math.log2(k + 2) for k in range(len(group))]
    return -weights[rank] / sum(weights)


def load_reward_function(path: str | None, name: str | None, key: str = "custom_reward_function", kwargs: dict | None = None) -> RewardFn:
    """The user's function `name` from the Python file `path`, given `kwargs` on every call besides the four
    arguments (verl's reward_kwargs), or the built-in rules when no path is given; errors name the keys under `key`."""
    if not path:
        return default_compute_score
    if not os.path.isfile(path):
        raise RewardError(f"{key}.path={path!r}: no such file")
    spec = importlib.util.spec_from_file_location("fsdptrain_custom_reward", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        raise RewardError(f"{key}.path={path!r} failed to import: {type(e).__name__}: {e}") from e
    name = name or "compute_score"
    function = getattr(module, name, None)
    if not callable(function):
        raise RewardError(f"{key}.{'function' if key.startswith('reward.sources') else 'name'}={name!r}: {path} defines no such function")
    if not kwargs:
        return function
    try:
        inspect.signature(function).bind("data_source", "solution_str", "ground_truth", {}, **kwargs)
    except TypeError as e:
        raise RewardError(f"{key}.reward_kwargs: {path}'s {name} cannot take {sorted(kwargs)}: {e}") from None
    return functools.partial(function, **kwargs)


SOURCE = "source/"  # the prefix of a reward source's own score among a sample's scores


@dataclass(frozen=True)
class RewardSource:
    name: str
    fn: RewardFn
    weight: float


def load_reward_sources(sources: Sequence[Any]) -> list[RewardSource]:
    """reward.sources as RewardSources: each a built-in verifier, or a function of a user's file."""
    return [RewardSource(s.name, load_reward_function(s.path, s.function, f"reward.sources[{i}]") if s.path else VERIFIERS[s.function], s.weight)
            for i, s in enumerate(sources)]


def weighted_sources(sources: Sequence[RewardSource]) -> RewardFn:
    """One reward function of verl's signature over several sources: `score` is the weighted sum of their scores,
    `acc` the first source's, and each source's own score is kept as `source/NAME`."""

    def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None,
                      images: list[Image.Image] | None = None) -> dict:
        result = {"score": 0.0}
        for source in sources:
            scores = score_sample(source.fn, data_source, solution_str, ground_truth, extra_info, f"reward source {source.name!r}", images)
            result["score"] += source.weight * scores["score"]
            result.setdefault("acc", scores["acc"])
            result[f"{SOURCE}{source.name}"] = scores["score"]
        return result

    return compute_score


def entry_sources(fn: RewardFn, keys: Sequence[str]) -> RewardFn:
    """verl's GDPO sources (algorithm.gdpo_reward_keys): entries of one reward function's dict, each kept as
    `source/KEY`; `score` and `acc` stay the function's own."""

    def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None,
                      images: list[Image.Image] | None = None) -> dict:
        scores = score_sample(fn, data_source, solution_str, ground_truth, extra_info, "a response", images)
        if missing := [key for key in keys if key not in scores]:
            raise RewardError(f"algorithm.gdpo_reward_keys: the reward function returned no {', '.join(missing)} (its entries: "
                              f"{', '.join(sorted(scores))}); return a dict with each key")
        return {**scores, **{f"{SOURCE}{key}": scores[key] for key in keys}}

    return compute_score


def with_extra_info(fn: RewardFn, extra: dict[str, Any]) -> RewardFn:
    """`fn`, each call's extra_info gaining `extra` (verl's GDPO reward manager's trainer.experiment_name)."""

    def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None,
                      images: list[Image.Image] | None = None) -> Any:
        return call_reward(fn, data_source, solution_str, ground_truth, {**(extra_info or {}), **extra}, images)

    return compute_score


def asks_for_images(fn: RewardFn) -> bool:
    """Whether a reward function takes a row's images: it has a parameter named `images`."""
    try:
        return "images" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a callable without a signature Python can read
        return False


def call_reward(fn: RewardFn, data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None, images: list[Image.Image] | None) -> Any:
    """`fn` on one sample, given its images where it asks for them."""
    if images is not None and asks_for_images(fn):
        return fn(data_source, solution_str, ground_truth, extra_info, images=images)
    return fn(data_source, solution_str, ground_truth, extra_info)


def score_sample(fn: RewardFn, data_source: str, response: str, ground_truth: Any, extra_info: dict | None, sample: str,
                 images: list[Image.Image] | None = None) -> dict:
    """The reward of one sample as a dict with a float `score` (and `acc`: the given one, else score > 0); a failure
    or a result that is not a finite number raises naming the sample, never a silent 0."""
    try:
        result = call_reward(fn, data_source, response, ground_truth, extra_info, images)
    except Exception as e:
        raise RewardError(f"the reward function failed on {sample}: {type(e).__name__}: {e}") from e
    scores = dict(result) if isinstance(result, dict) else {"score": result}
    try:
        scores = {k: float(v) for k, v in scores.items()}
    except (TypeError, ValueError):
        raise RewardError(f"the reward function returned {result!r} for {sample}: not a number or a dict of numbers") from None
    if "score" not in scores or not math.isfinite(scores["score"]):
        raise RewardError(f"the reward function returned {result!r} for {sample}: a finite score is required")
    scores.setdefault("acc", float(scores["score"] > 0))
    return scores


def score_responses(fn: RewardFn, tokenizer: PreTrainedTokenizerBase, prompts: Sequence[Prompt], responses: Sequence[Generation],
                    group_ids: Sequence[int], where: str) -> list[dict]:
    """Each response's scores (as `score_sample`) with its text (`response`, a multi-turn trajectory's with its
    tool and user turns, as verl decodes it) and the number of tokens the policy generated (`response_length`);
    response i answers prompts[group_ids[i]]. The row's `extra_info` gains the response's group (`group_responses`:
    the texts of its prompt's responses, in rollout order; `group_rank`: its place there, a beam's rank in beam
    search) and a trajectory's AgentTrace.reward_info. A function that asks for images gets the prompt's, read once a
    prompt. `where` starts the name of a failing sample."""
    texts = [tokenizer.decode(response.response_ids, skip_special_tokens=True) for response in responses]
    images: dict[int, list[Image.Image]] = {}
    groups: dict[int, list[str]] = {}
    for text, group in zip(texts, group_ids, strict=True):
        groups.setdefault(group, []).append(text)
    scored = []
    for response, text, group, place in zip(responses, texts, group_ids, members(group_ids), strict=True):
        prompt = prompts[group]
        sample = f"{where}prompt {group} ({prompt.data_source}), response {place}"
        extra_info = {**prompt.extra_info, "group_responses": groups[group], "group_rank": place}
        if response.trace is not None:
            extra_info.update(response.trace.reward_info())
        if asks_for_images(fn) and group not in images:
            images[group] = [open_image(value, i) for i, value in enumerate(prompt.stored_images or [])]
        scores = score_sample(fn, prompt.data_source, text, prompt.ground_truth, extra_info, sample, images.get(group))
        scored.append({**scores, "response": text, "response_length": response.generated_tokens})
    return scored


def overlong_penalty(response_length: int, max_response_length: int, buffer_length: int, penalty_factor: float) -> float:
    """DAPO's soft overlong punishment: 0 up to max_response_length - buffer_length tokens, then falling linearly
    to -penalty_factor at max_response_length."""
    exceed = response_length - (max_response_length - buffer_length)
    return min(-exceed / buffer_length * penalty_factor, 0.0)


@dataclass(frozen=True)
class OverlongBuffer:
    """DAPO's overlong penalty settings (reward_model.overlong_buffer)."""

    max_response_length: int
    length: int
    penalty_factor: float


def no_reward(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """The reward function of a run scored by its batch sources alone (a reward model, a remote server)."""
    return 0.0


@dataclass(frozen=True)
class BatchSource:
    """A reward source that scores a whole rollout at once (a reward model, a remote server): `score(generations,
    prompts, group_ids)` gives one number per response (response i answers prompts[group_ids[i]])."""

    name: str
    weight: float
    score: Callable[[Sequence[Generation], Sequence[Prompt], Sequence[int]], list[float]]


@dataclass(frozen=True)
class Scorer:
    """A rollout's scores: the reward function on each response, plus each batch source's score times its weight
    (kept as `source/NAME`), and `seq_reward`, what the step trains on, which adds DAPO's overlong penalty to
    `score` where `overlong` is set."""

    reward_fn: RewardFn
    tokenizer: PreTrainedTokenizerBase
    overlong: OverlongBuffer | None
    batch_sources: Sequence[BatchSource] = ()

    def __call__(self, generations: Sequence[Generation], prompts: Sequence[Prompt], group_ids: Sequence[int], where: str) -> list[dict]:
        """Each response's scores; response i answers prompts[group_ids[i]]."""
        scores = score_responses(self.reward_fn, self.tokenizer, prompts, generations, group_ids, f"{where}, this rank's ")
        for source in self.batch_sources:
            values = source.score(generations, prompts, group_ids)
            for scored, value, group, place in zip(scores, values, group_ids, members(group_ids), strict=True):
                if not math.isfinite(value):
                    raise RewardError(f"{source.name} scored {value} for {where}, this rank's prompt {group}, response {place}")
                scored[f"{SOURCE}{source.name}"] = value
                scored["score"] += source.weight * value
        if self.reward_fn is no_reward:
            for scored in scores:
                scored["acc"] = float(scored["score"] > 0)
        for scored in scores:
            scored["seq_reward"] = scored["score"]
            if self.overlong is not None:
                scored["overlong_penalty"] = overlong_penalty(scored["response_length"], self.overlong.max_response_length, self.overlong.length,
                                                              self.overlong.penalty_factor)
                scored["seq_reward"] += scored["overlong_penalty"]
        return scores
