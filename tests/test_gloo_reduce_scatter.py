"""FSDP2's reduce-scatter over gloo with reused buffers: the values of gloo's own reduce-scatter, on 2 and 4 ranks.
The dp=2 and sp=2 training tests run it inside FSDP2 (tests/test_sft_distributed.py, tests/test_ulysses.py)."""

import pytest

from conftest import torchrun


@pytest.mark.parametrize("nproc", [2, 4])
def test_matches_gloo_reduce_scatter_and_never_overwrites_an_output(nproc):
    result = torchrun(nproc, "tests.gloo_reduce_scatter_check", [])
    assert result.stdout.count("ok") == nproc
