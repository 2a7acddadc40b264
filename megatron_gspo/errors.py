"""The error every user-facing command reports as one named line (exit 2), without a traceback."""


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the field and says why."""
