"""Subcommands that work on the backing directory itself (no daemon needed)."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Added once export/gc/check land (issue 4)."""
