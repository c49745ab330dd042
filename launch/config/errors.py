"""The error of an invalid launcher configuration."""
from __future__ import annotations

import click

__all__ = ["ConfigError"]


class ConfigError(click.ClickException):
    """An invalid configuration: reported once per node, before any collective."""

    exit_code = 2
