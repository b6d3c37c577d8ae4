"""Save, resume and rotate checkpoints; shared by every trainer.

    {root}/latest_checkpointed_iteration.txt   the last complete step, written atomically after the rename
    {root}/global_step_{N}/meta.json            step, contents, world size
                          model/ optimizer/     torch.distributed.checkpoint shards (reshardable)
                          {companion}/model/ ... a companion's (a PPO critic's) model and optimizer, likewise;
                                                a companion without an optimizer (a synced reference) whole
                          extra/                the trainer's state objects (scheduler, data position, ...)
                                                and config (state.pt), RNG per rank
                          huggingface/          config, tokenizer, and safetensors weights with hf_model
                          lora_adapter/         with lora_adapter, the adapters in peft's format

A LoRA run's model/ holds its adapters alone: the frozen weights are the pretrained folder's, read again at resume.

A save is written to `.global_step_{N}.tmp` and renamed only after every rank has finished, so a process
killed mid-save leaves an unfinished temporary folder that is never taken for a checkpoint.
"""

import json
import os
import random
import re
import shutil
from functools import partial
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from transformers import PreTrainedTokenizerBase

from fsdptrain.checkpoint.hf_export import ARCHITECTURE_KEYS, save_hf_folder
from fsdptrain.config.shared import LoRASettings, TrainerConfig
from fsdptrain.distributed.fsdp import persistent_buffers
from fsdptrain.distributed.launcher import fault_point
from fsdptrain.distributed.mesh import Parallel
from fsdptrain.dtypes import DTYPES
from fsdptrain.errors import ConfigError
from fsdptrain.models.lora import adapter_weights, merged_weights, save_adapter

TRACKER = "latest_checkpointed_iteration.txt"
STEP_DIR = re.compile(r"^global_step_(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read; the previous complete checkpoint is untouched."""


def write_atomic(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def complete_checkpoints(root: str) -> list[int]:
    """Steps of the complete checkpoints under root, oldest first (temporary folders are not complete)."""
    if not os.path.isdir(root):
        return []
    steps = [int(m.group(1)) for name in os.listdir(root) if (m := STEP_DIR.match(name))]
    return sorted(s for s in steps if os.path.isfile(os.path.join(root, f"global_step_{s}", "meta.json")))


def read_meta(step_dir: str) -> dict[str, Any]:
    path = os.path.join(step_dir, "meta.json")
    if not os.path.isfile(path):
        raise ConfigError(f"trainer.resume_from_path={step_dir!r} is not a checkpoint folder (no meta.json)")
    with open(path) as f:
        return json.load(f)


def _rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def saved_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """The model's sharded state as a checkpoint holds it: a trained model's without its frozen parameters (a LoRA
    model's pretrained weights); a model that changes without an optimizer (a synced reference) whole."""
    if optimizer is None:
        return get_model_state_dict(model)
    frozen = {name for name, param in model.named_parameters(remove_duplicate=False) if not param.requires_grad}
    return {name: value for name, value in get_model_state_dict(model).items() if name not in frozen}


ADAPTER_SHAPE = ("rank", "alpha", "target_modules", "exclude_modules")  # what saved adapters' shapes and names depend on


def lora_matches(saved: dict[str, Any] | None, current: dict[str, Any] | None) -> bool:
    """Whether adapters saved with `saved` load into a model built with `current` (the base folder may move)."""
    if saved is None or current is None:
        return saved is current
    return all(saved[k] == current[k] for k in ADAPTER_SHAPE)


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class CheckpointManager:
    """Checkpoints of one trained model and its optimizer, of its `companions` (other models with their optimizers,
    by name: a PPO critic; or with None, a model that moves untrained: a synced reference), plus the trainer's `states` (the LR schedules, a data position, a KL
    controller: anything with state_dict/load_state_dict), saved by rank 0 under their names. The Hugging Face
    export is the trained model's."""

    def __init__(
        self,
        config: TrainerConfig,
        parallel: Parallel,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        tokenizer: PreTrainedTokenizerBase,
        model_dtype: str,
        states: dict[str, Stateful],
        run_config: dict,
        companions: dict[str, tuple[nn.Module, torch.optim.Optimizer | None]] | None = None,
        lora: LoRASettings | None = None,
        base_model: str | None = None,
    ):
        self.config = config
        self.root = config.default_local_dir
        self.parallel = parallel
        self.model = model
        self.optimizer = optimizer
        self.tokenizer = tokenizer
        self.model_dtype = model_dtype
        self.states = states
        self.sharded = {"": (model, optimizer), **(companions or {})}  # folder prefix -> (model, optimizer)
        self.run_config = run_config
        self.lora, self.base_model = lora, base_model
        self.save_contents = list(config.checkpoint.save_contents)
        self.load_contents = list(config.checkpoint.load_contents or self.save_contents)

    def _agree(self, error: BaseException | None) -> None:
        """Raise on every rank if any rank failed, so no rank waits forever on the others."""
        failed = torch.tensor([error is not None], dtype=torch.int32, device=self.parallel.device)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=self.parallel.group)
        if error is not None:
            disk = " (is the disk full or not writable?)" if isinstance(error, (OSError, dcp.CheckpointException)) else ""
            raise CheckpointError(
                f"checkpoint save under {self.root} failed{disk}; the previous checkpoint is intact: {str(error).splitlines()[0]}"
            ) from error
        if failed.item():
            raise CheckpointError(f"checkpoint save under {self.root} failed on another rank; the previous checkpoint is intact")

    def _run_everywhere(self, fn) -> None:
        try:
            fn()
            error = None
        except (OSError, RuntimeError, ValueError, dcp.CheckpointException) as e:
            error = e
        self._agree(error)

    def _run_on_main(self, fn) -> None:
        self._run_everywhere(lambda: fn() if self.parallel.is_main else None)

    # ---- save -------------------------------------------------------------------------------------------
    def save(self, step: int) -> str:
        final = os.path.join(self.root, f"global_step_{step}")
        tmp = os.path.join(self.root, f".global_step_{step}.tmp")

        def prepare() -> None:
            # Leftovers of saves killed midway were removed when this run locked its directory (run_lock.py); a
            # temporary directory here now would be another writer's, which is never removed.
            os.makedirs(os.path.join(tmp, "extra"))

        self._run_on_main(prepare)
        for prefix, (model, optimizer) in self.sharded.items():
            if "model" in self.save_contents:
                self._run_everywhere(partial(dcp.save, saved_state(model, optimizer), checkpoint_id=os.path.join(tmp, prefix, "model"),
                                             process_group=self.parallel.group))
            if "optimizer" in self.save_contents and optimizer is not None:
                state = get_optimizer_state_dict(model, optimizer)
                self._run_everywhere(partial(dcp.save, state, checkpoint_id=os.path.join(tmp, prefix, "optimizer"), process_group=self.parallel.group))
        if "extra" in self.save_contents:
            self._run_everywhere(lambda: torch.save(_rng_state(), os.path.join(tmp, "extra", f"rng_rank{self.parallel.rank}.pt")))
            extra = {
                "global_step": step,
                "states": {name: state.state_dict() for name, state in self.states.items()},
                "config": self.run_config,
            }
            self._run_on_main(lambda: torch.save(extra, os.path.join(tmp, "extra", "state.pt")))
        self._export(tmp)

        def publish() -> None:
            meta = {
                "global_step": step,
                "contents": self.save_contents,
                "companions": sorted(name for name in self.sharded if name),
                "world_size": self.parallel.world_size,
                "model_dtype": self.model_dtype,
                "lora": self._lora_meta(),
            }
            write_atomic(os.path.join(tmp, "meta.json"), json.dumps(meta))
            if os.path.exists(final):  # re-saving a step (a run resumed before it): replace it whole
                shutil.rmtree(final)
            os.replace(tmp, final)
            write_atomic(os.path.join(self.root, TRACKER), str(step))
            self._rotate()

        fault_point("save", step)
        self._run_on_main(publish)
        return final

    def save_best(self, step: int, metrics: dict[str, float]) -> str:
        """The trained model's Hugging Face folder at `root`/best/huggingface (trainer.best_model.save), with
        best/meta.json naming its step and `metrics`. `best` is a link to best_step_N/, swapped in one rename once
        the new folder is whole: a crash mid-save leaves the previous best in place."""
        name = f"best_step_{step}"
        tmp, final = os.path.join(self.root, f".{name}.tmp"), os.path.join(self.root, name)
        self._run_on_main(lambda: os.makedirs(tmp))
        self._export(tmp, weights=True)

        def publish() -> None:
            write_atomic(os.path.join(tmp, "meta.json"), json.dumps({"global_step": step, **metrics}))
            if os.path.exists(final):  # re-saving a step (a run resumed before it)
                shutil.rmtree(final)
            os.replace(tmp, final)
            link = os.path.join(self.root, ".best.tmp")
            os.symlink(name, link)
            os.replace(link, os.path.join(self.root, "best"))
            for old in os.listdir(self.root):
                if old.startswith("best_step_") and old != name:
                    shutil.rmtree(os.path.join(self.root, old), ignore_errors=True)

        self._run_on_main(publish)
        return final

    def _export(self, tmp: str, weights: bool | None = None) -> None:
        """The folders other tools load: huggingface/ (config and tokenizer; the merged weights with hf_model, or
        where `weights` says) and, with lora_adapter, the adapters in peft's format."""
        hf_dtype = self.config.checkpoint.hf_dtype or self.model_dtype
        full_state = None
        if "hf_model" in self.save_contents if weights is None else weights:
            # Rank 0 keeps each full parameter in host memory as it arrives; the others drop theirs at once.
            full_state = {}
            for name, tensor in merged_weights(self.model, DTYPES[hf_dtype]):
                if self.parallel.is_main:
                    full_state[name] = tensor.cpu()
            full_state.update((name, buffer.cpu()) for name, buffer in persistent_buffers(self.model) if self.parallel.is_main)
        self._run_on_main(
            lambda: save_hf_folder(
                os.path.join(tmp, "huggingface"), self.model.config, self.model.generation_config, self.tokenizer, full_state, hf_dtype,
                self.base_model,
            )
        )
        if "lora_adapter" in self.save_contents:
            adapters = adapter_weights(self.model)
            self._run_on_main(lambda: save_adapter(os.path.join(tmp, "lora_adapter"), adapters, self.lora, self.base_model))

    def _lora_meta(self) -> dict[str, Any] | None:
        """The adapters' shape settings and the pretrained folder they were trained on."""
        if self.lora is None:
            return None
        return {**{key: getattr(self.lora, key) for key in ADAPTER_SHAPE}, "base_model": self.base_model}

    def _rotate(self) -> None:
        keep = self.config.max_ckpt_to_keep
        if keep is None:
            return
        for step in complete_checkpoints(self.root)[:-keep]:
            shutil.rmtree(os.path.join(self.root, f"global_step_{step}"), ignore_errors=True)

    # ---- resume -----------------------------------------------------------------------------------------
    def _resume_dir(self) -> str | None:
        mode = self.config.resume_mode
        if mode == "disable":
            return None
        if mode == "resume_path" or (mode == "auto" and self.config.resume_from_path and self.config.auto_resumes_from_path):
            path = self.config.resume_from_path
            if not os.path.isdir(path):
                raise ConfigError(f"trainer.resume_from_path={path!r} does not exist")
            read_meta(path)
            return path
        tracker = os.path.join(self.root, TRACKER)
        if not os.path.isfile(tracker):
            return None
        with open(tracker) as f:
            path = os.path.join(self.root, f"global_step_{int(f.read().strip())}")
        if not os.path.isfile(os.path.join(path, "meta.json")):
            raise CheckpointError(f"{tracker} names {path}, which is not a complete checkpoint")
        return path

    def _check_compatible(self, path: str, meta: dict[str, Any]) -> None:
        with open(os.path.join(path, "huggingface", "config.json")) as f:
            saved = json.load(f)
        current = self.model.config.to_dict()
        different = {k: (saved.get(k), current.get(k)) for k in ARCHITECTURE_KEYS if saved.get(k) != current.get(k)}
        if different:
            raise ConfigError(
                f"checkpoint {path} is of another model architecture than model.partial_pretrain: "
                + ", ".join(f"{k}: checkpoint {a!r} vs model {b!r}" for k, (a, b) in different.items())
            )
        missing = [c for c in self.load_contents if c not in meta["contents"]]
        if missing:
            raise ConfigError(
                f"trainer.checkpoint.load_contents asks for {missing}, but {path} holds only {meta['contents']}"
            )
        saved_lora, lora = meta.get("lora"), self._lora_meta()
        if {"model", "optimizer"} & set(self.load_contents) and not lora_matches(saved_lora, lora):
            raise ConfigError(f"checkpoint {path} was trained with LoRA {saved_lora}, this run with {lora}: resume with the same "
                              "lora_rank, lora_alpha, target_modules and exclude_modules (lora_rank=0: full weights)")
        companions = sorted(name for name in self.sharded if name)
        if {"model", "optimizer"} & set(self.load_contents) and companions != meta.get("companions", []):
            raise ConfigError(f"checkpoint {path} holds the trained models {['actor', *meta.get('companions', [])]}, this run trains "
                              f"{['actor', *companions]}: resume a run of the same algorithm (a critic comes with algorithm.adv_estimator=gae, a "
                              "saved reference with actor_rollout_ref.ref.sync_ref_model=true)")

    def resume(self) -> int:
        """Load the checkpoint that resume_mode selects; returns the step to continue from (0 if none)."""
        path = self._resume_dir()
        if path is None:
            return 0
        meta = read_meta(path)
        self._check_compatible(path, meta)
        for prefix, (model, optimizer) in self.sharded.items():
            if "model" in self.load_contents:
                state = saved_state(model, optimizer)
                dcp.load(state, checkpoint_id=os.path.join(path, prefix, "model"), process_group=self.parallel.group)
                set_model_state_dict(model, state, options=StateDictOptions(strict=False))
            if "optimizer" in self.load_contents and optimizer is not None:
                state = get_optimizer_state_dict(model, optimizer)
                dcp.load(state, checkpoint_id=os.path.join(path, prefix, "optimizer"), process_group=self.parallel.group)
                set_optimizer_state_dict(model, optimizer, state)
        if "extra" not in self.load_contents:
            return 0
        extra = torch.load(os.path.join(path, "extra", "state.pt"), weights_only=False)
        missing = sorted(set(self.states) - set(extra["states"]))
        if missing:
            raise ConfigError(f"checkpoint {path} has no saved state for {missing} (it holds {sorted(extra['states'])})")
        for name, state in self.states.items():
            state.load_state_dict(extra["states"][name])
        rng_path = os.path.join(path, "extra", f"rng_rank{self.parallel.rank}.pt")
        if os.path.isfile(rng_path):  # absent when resuming on more ranks than saved
            _set_rng_state(torch.load(rng_path, weights_only=False))
        return int(extra["global_step"])
