"""One error family for everything a user can get wrong.

Every message names *where* (the schedule path), *what* is wrong and *how to fix it*, because the
person reading it is usually three modules deep in someone else's model.
"""

from __future__ import annotations


class SlapoError(Exception):
    """Base class of every error Slapo raises on purpose."""


class SchedulingError(SlapoError):
    """A primitive was called with input that cannot be applied.

    Raised *before* any mutation: the model and the schedule are unchanged afterwards.
    """

    def __init__(self, path: str, problem: str, fix: str | None = None):
        self.path = path
        self.problem = problem
        self.fix = fix
        where = path if path else "<root>"
        msg = f"[{where}] {problem}"
        if fix:
            msg += f" Fix: {fix}"
        super().__init__(msg)


class VerificationError(SlapoError):
    """The scheduled model does not compute what the original computed."""


class TraceError(SchedulingError):
    """A module could not be captured as a graph."""
