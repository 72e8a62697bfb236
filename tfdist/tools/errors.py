"""The error every tool raises for a user's mistake in a config or on the command line."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config is invalid; the message lists every problem found."""
