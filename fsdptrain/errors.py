"""The error every layer raises for a setting or an input that cannot be used before any work starts."""


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message names the key."""
