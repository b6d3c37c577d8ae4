"""The shared engine used as a second trainer would use it (tests/checks/engine_check.py, under torchrun on 2 ranks)."""

from conftest import torchrun


def test_trained_and_frozen_models_log_probs_optimizer_and_full_parameters(ids_llama):
    result = torchrun(2, "tests.checks.engine_check", [ids_llama])
    assert result.stdout.count("ok") == 2
