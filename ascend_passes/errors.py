"""Exceptions a user of ascend_passes can cause, each with a message that says what to change."""

from __future__ import annotations


class AscendPassesError(Exception):
    """Base class of every error ascend_passes raises on purpose."""


class ConfigError(AscendPassesError, ValueError):
    """A bad option, an impossible setting, or a missing prerequisite (for example a process group)."""


class PassError(AscendPassesError, RuntimeError):
    """A pass raised or left a broken graph while ``strict=True``; names the pass."""

    def __init__(self, pass_name: str, message: str) -> None:
        super().__init__(f"pass '{pass_name}' failed: {message}")
        self.pass_name = pass_name


class VerificationError(AscendPassesError, AssertionError):
    """The rewritten graph's outputs differ from the original graph's on the example inputs."""
