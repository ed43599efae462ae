"""Runtimes: turn a schedule into something that trains (single device for now)."""

from .build import build

__all__ = ["build"]
