"""Sandlot: one sandbox shared by a human and an AI agent, at the same time."""

__version__ = "0.1.0"

__all__ = ["__version__"]
