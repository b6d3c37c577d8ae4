"""The GRPO smoke run's reward (scripts/smoke_grpo.sh): the share of the response's characters that are digits, a
habit a tiny random model picks up in a few steps, so that a score that does not rise means a trainer that does not
learn."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    return sum(c.isdigit() for c in solution_str) / max(len(solution_str), 1)
