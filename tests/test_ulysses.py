"""Ulysses sequence parallelism under torchrun: the losses, validation and weights of the run without it."""


import pytest

from conftest import assert_same_run, run_sft

pytestmark = pytest.mark.slow

SAVE_HF = "[model,optimizer,extra,hf_model]"
# Micro-batches of 2 arithmetic chats (odd and even lengths) packed in one row, so the split between the SP
# ranks falls inside a sample; the padding to a multiple of S is a segment of its own that carries no loss.
RUN = dict(trainer__checkpoint__save_contents=SAVE_HF, trainer__test_freq=3)


@pytest.fixture(scope="module")
def llama_sp1(tmp_path_factory, tiny_llama, chat_data):
    out = str(tmp_path_factory.mktemp("llama_sp1"))
    run_sft(1, tiny_llama, chat_data, out, **RUN)
    return out


def test_sp2_equals_sp1(tmp_path, tiny_llama, chat_data, llama_sp1):
    out = str(tmp_path)
    run_sft(2, tiny_llama, chat_data, out, ulysses_sequence_parallel_size=2, model__enable_gradient_checkpointing="true",
            model__fsdp_config__cpu_offload="true", **RUN)
    assert_same_run(out, llama_sp1)


def test_dp2_sp2_equals_one_process(tmp_path, tiny_llama, chat_data, llama_sp1):
    """Two data-parallel groups of two SP ranks each (the loss is the global token mean, so dp changes nothing)."""
    out = str(tmp_path)
    run_sft(4, tiny_llama, chat_data, out, ulysses_sequence_parallel_size=2, **RUN)
    assert_same_run(out, llama_sp1)


def test_qwen2_with_fewer_kv_heads_than_sp(tmp_path, tiny_qwen2, chat_data):
    """Two KV heads over four SP ranks: they are repeated so that each rank gets one."""
    sp1, sp4 = str(tmp_path / "sp1"), str(tmp_path / "sp4")
    run_sft(1, tiny_qwen2, chat_data, sp1, **RUN)
    run_sft(4, tiny_qwen2, chat_data, sp4, ulysses_sequence_parallel_size=4, data__micro_batch_size_per_gpu=4, **RUN)
    assert_same_run(sp4, sp1)


def test_heads_not_divisible_by_sp_fail_at_start(tmp_path, tiny_llama, chat_data):
    result = run_sft(3, tiny_llama, chat_data, str(tmp_path), check=False, ulysses_sequence_parallel_size=3,
                     data__train_batch_size=9, data__micro_batch_size_per_gpu=3)
    assert result.returncode != 0
    assert "ulysses_sequence_parallel_size (3) must divide the model's num_attention_heads (4)" in result.stderr
