"""FSDP2's collectives over gloo (point-to-point reduce-scatter and all-gather): the values of
gloo's own, on 2 and 4 ranks. The dp=2 and sp=2 training tests run them inside FSDP2 (tests/test_sft_distributed.py,
tests/test_ulysses.py)."""

import pytest

from conftest import torchrun


@pytest.mark.parametrize("nproc", [2, 4])
def test_match_gloo_collectives_and_never_overwrite_an_output(nproc):
    result = torchrun(nproc, "tests.checks.gloo_comms_check", [])
    assert result.stdout.count("ok") == nproc
