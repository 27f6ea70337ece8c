"""The one error a command raises for the user's own mistakes."""

from __future__ import annotations


class UsageError(Exception):
    """A problem with the user's arguments or files: printed as one line, exit code 2."""
