"""Whether a run would start, checked on any machine before the GPUs are rented, without torchrun or a GPU:
`python -m fsdptrain.check {sft,grpo} [--nnodes M] [--nproc-per-node N] [--device cuda|cpu] key=value ...`.

It reads the command line exactly as the trainer would for that launch shape (verl's keys translated, each
mapped or accepted one named with its reason; every problem reported at once), then everything the trainer reads
before its processes work together: the data files (every row tokenized, as training will), the model folder's
config and tokenizer, the reward function, the tools. It prints the resolved sizes (ranks, batches per rank,
steps, tokens) and exits 0 only if the run would start; otherwise 1, with every problem it found.
"""

import argparse
import sys
from typing import TYPE_CHECKING

import torch
from hydra import compose, initialize_config_module
from hydra.errors import HydraException
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, PretrainedConfig

from fsdptrain.config.verl_keys import default_differences, translate
from fsdptrain.distributed.mesh import World
from fsdptrain.errors import ConfigError, UserError

if TYPE_CHECKING:
    from fsdptrain.trainer.setup import ModelSpec

EPILOG = """key=value: the trainer's own command line (fsdptrain's keys or verl's); every key and its default:
`python -m fsdptrain.sft_trainer --help`, `python -m fsdptrain.grpo_trainer --help`.

examples:
  python -m fsdptrain.check sft --nproc-per-node 8 data.train_files=train.parquet model.partial_pretrain=/models/qwen
  python -m fsdptrain.check grpo --nnodes 2 --nproc-per-node 8 $(cat my_verl_script_args.txt)
  python -m fsdptrain.check grpo --device cpu --nproc-per-node 2 ...   # the packages are checked too (this machine)

docs: docs/sft.md, docs/grpo.md, docs/from_verl.md (running a verl script)"""


def micro_batches(batching) -> str:
    if batching.dynamic:
        return f"packed up to {batching.max_tokens} tokens a forward pass ({batching.max_tokens_key})"
    return f"{batching.size} sequences a forward pass ({batching.size_key})"


def processes(world: World, sp: int, training: int | None = None) -> str:
    """The processes, and the data x sequence parallel layout of the `training` ones (default: all)."""
    return (f"processes: {world.world_size} ({world.world_size // world.host_processes} node(s) x {world.host_processes}), data-parallel "
            f"{(training or world.world_size) // sp} x sequence-parallel {sp}, on {world.device.type}")


def grpo_sizes(overrides: list[str], problems: list[str], world: World) -> list[str]:
    from fsdptrain.trainer.grpo import read_grpo_inputs
    from fsdptrain.trainer.grpo_plan import read_grpo_config, resolve_grpo

    inputs = read_grpo_inputs(*resolve_grpo(read_grpo_config(composed("grpo_trainer", overrides), problems, world), world))
    plan, data = inputs.plan, inputs.plan.data
    builds(inputs.hf_config, plan.actor_model, "actor_rollout_ref.model.path")
    if inputs.critic_config is not None:
        builds(inputs.critic_config, plan.critic_model, "critic.model.path", AutoModelForTokenClassification)
    n = plan.request.n
    trainers = world.world_size - plan.rollout_ranks
    dp = trainers // plan.sp_size
    per_rank = data.train_batch_size // dp
    placement = []
    if (asynchronous := plan.asynchronous) is not None:
        servers = asynchronous.rollout_ranks
        lag = "unbounded" if asynchronous.max_lag is None else f"at most {asynchronous.max_lag} version(s)"
        if servers:
            placement = [f"placement (separate_async): ranks 0-{trainers - 1} train, ranks {trainers}-{trainers + servers - 1} generate "
                         f"({trainers // servers} training rank(s) each); {asynchronous.lead} batch(es) asked for ahead, a trained group's lag {lag}"]
        else:
            bound = "" if asynchronous.max_lag is None else ", each step waiting for its own batch's groups" if asynchronous.wait else ", a staler one dropped"
            placement = [f"placement (colocate_async): every rank generates and trains; its unfinished responses stay in flight across steps, "
                         f"{asynchronous.lead} batch(es) in flight ahead, a trained group's lag {lag}{bound}"]
    return [
        processes(world, plan.sp_size, trainers),
        *placement,
        f"training prompts: {len(inputs.train)} (validation: {len(inputs.val)}); steps: {inputs.total_steps}",
        f"a step: {data.train_batch_size} prompts x {n} responses = {data.train_batch_size * n} sequences, "
        f"{per_rank} prompts a data-parallel rank; {per_rank * n // plan.update.mini_batch_sequences} optimizer "
        f"step(s) x {plan.update.ppo_epochs} epoch(s) of {plan.update.mini_batch_sequences} sequences a rank",
        f"the update: {micro_batches(plan.update_batching)}; old log-probs: {micro_batches(plan.log_prob_batching)}",
        f"a sequence: at most {plan.sequence_length} tokens ({data.max_prompt_length} prompt + {data.max_response_length} response); "
        f"a step at most {data.train_batch_size * n * plan.sequence_length} tokens",
        f"estimator {plan.advantage.estimator}, loss {plan.loss.loss_mode} ({plan.loss.policy_agg_mode}), rollout engine "
        f"{plan.engine_name}{', a critic' if plan.critic else ''}{', a reference model' if plan.needs_reference else ''}",
    ]


def sft_sizes(overrides: list[str], problems: list[str], world: World) -> list[str]:
    from fsdptrain.trainer.sft import read_sft_inputs
    from fsdptrain.trainer.sft_plan import plan_sft, read_sft_config

    inputs = read_sft_inputs(plan_sft(read_sft_config(composed("sft_trainer", overrides), problems, world)))
    data, sp = inputs.plan.data, inputs.plan.sp_size
    builds(inputs.hf_config, inputs.plan.model, "model.partial_pretrain")
    dp = world.world_size // sp
    return [
        processes(world, sp),
        f"training samples: {len(inputs.train)} (validation: {len(inputs.val)}); steps: {inputs.total_steps}",
        f"a step: {data.train_batch_size} samples, {data.train_batch_size // dp} a data-parallel rank; "
        f"{micro_batches(inputs.plan.micro_batching)}",
        f"a sample: at most {data.max_length} tokens; a step at most {data.train_batch_size * data.max_length} tokens",
    ]


def builds(hf_config: PretrainedConfig, spec: "ModelSpec", path_key: str, auto_class: type = AutoModelForCausalLM) -> None:
    """Build the model `spec` names on the meta device, as the trainer builds it (its attention included), so that
    what transformers cannot run is named here rather than in the first step."""
    from fsdptrain.models.loading import build_on_meta

    try:
        build_on_meta(hf_config, spec.model, spec.packed, auto_class)
    except (ValueError, ImportError, NotImplementedError, RuntimeError) as e:
        raise ConfigError(f"{path_key}={spec.path!r} ({hf_config.model_type}) cannot be built as the run would build it: "
                          f"{str(e).splitlines()[0]}") from e


def composed(config_name: str, overrides: list[str]):
    with initialize_config_module(config_module="fsdptrain.config", version_base=None):
        return compose(config_name=config_name, overrides=overrides)


def check(trainer: str, overrides: list[str], world: World) -> int:
    """0 and the run's sizes where the run would start; else 1 and its problems (printed)."""
    try:
        kept, problems = translate(overrides, trainer, world.world_size)
        sizes = (grpo_sizes if trainer == "grpo" else sft_sizes)(kept, problems, world)
    except (UserError, HydraException) as e:
        print(f"fsdptrain.check: the run would not start:\n{e}", file=sys.stderr)
        return 1
    print(f"fsdptrain.check: the {trainer} run would start.")
    for line in sizes:
        print(f"  {line}")
    if differences := default_differences(trainer, [*overrides, *kept]):
        print("  defaults that are not verl 0.9's, of the keys this command line leaves unset (why: docs/from_verl.md):")
        for line in differences:
            print(f"    {line}")
    if not world.here:
        print(f"  not checked: the optional packages the run imports (loggers, vLLM): --device {world.device.type} is not this machine's")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fsdptrain.check", usage="%(prog)s {sft,grpo} [options] key=value ...",
                                     description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=EPILOG)
    parser.add_argument("trainer", choices=("sft", "grpo"), help="the trainer whose command line it reads")
    parser.add_argument("--nnodes", type=int, default=1, help="nodes (torchrun's --nnodes)")
    parser.add_argument("--nproc-per-node", type=int, default=1, help="processes a node (torchrun's --nproc_per_node)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="the device the run will have (default: cuda)")
    args, overrides = parser.parse_known_args(argv)
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    here = device.type == "cpu" or torch.cuda.is_available()
    return check(args.trainer, overrides, World(0, args.nnodes * args.nproc_per_node, args.nproc_per_node, device, here))


if __name__ == "__main__":
    sys.exit(main())
