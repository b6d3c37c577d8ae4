"""The errors that are the user's to fix (a setting, a file, a data row, a reward function, a server), not bugs:
the entry points print their message once, without a traceback (trainer/report.py)."""


class UserError(Exception):
    """An input of the user's that cannot be used; the message names it (key, file, row) and what to do."""


class ConfigError(UserError, ValueError):
    """A configuration value that cannot be used; the message names the key."""
