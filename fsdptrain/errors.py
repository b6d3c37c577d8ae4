"""The errors that are not bugs: the user's to fix (a setting, a file, a data row, a reward function, a server),
or a rank of the run lost. The entry points print their message once, without a traceback (trainer/report.py)."""


class UserError(Exception):
    """An input of the user's that cannot be used; the message names it (key, file, row) and what to do."""


class ConfigError(UserError, ValueError):
    """A configuration value that cannot be used; the message names the key."""


class LostRankError(Exception):
    """A collective failed because a rank is gone or stuck; the message names the step, the collective and the
    ranks that stopped beating. `reporter`: whether this rank prints it (the lowest rank still beating);
    `report_within_s`: how long the others wait for it to have printed before they leave."""

    def __init__(self, message: str, reporter: bool, report_within_s: float):
        super().__init__(message)
        self.reporter = reporter
        self.report_within_s = report_within_s
