"""One-time notices: 2023 spellings that now do something different (e.g. TorchScript ->
torch.compile), and runtime behaviours a user should hear of once. A notice is a warning of
its own category, so a user can filter or escalate it (`warnings.simplefilter("error",
Slapo2023Notice)`), and it is shown once per process and key: a schedule applied to 48 layers
should not print 48 times."""

from __future__ import annotations

import warnings

_SHOWN: set[str] = set()


class Slapo2023Notice(UserWarning):
    """A 2023 API name was mapped onto today's behaviour; the message says how."""


def notice_once(key: str, message: str, stacklevel: int = 3,
                category: type[Warning] = Slapo2023Notice) -> bool:
    """Warn `message` the first time `key` is seen; returns whether it was shown. `category`:
    the warning class (the runtime's own notices have theirs, e.g.
    `runtime.token_mean.UnitMeanNotice`)."""
    if key in _SHOWN:
        return False
    _SHOWN.add(key)
    warnings.warn(message, category, stacklevel=stacklevel)
    return True


def was_shown(key: str) -> bool:
    """Whether `notice_once(key, ...)` has shown its notice (callers skip the work of deciding
    again, e.g. a host sync in every training step)."""
    return key in _SHOWN


def reset_notices() -> None:
    """Forget which notices were shown (tests)."""
    _SHOWN.clear()
