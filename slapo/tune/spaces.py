"""Deprecated module name: the ready spaces are `slapo.tune.model_spaces` (renamed so it no longer
collides with `slapo.tune.space`, the Space/Symbol machinery). This re-export stays only until
`tune/evaluators.py`, `tune/predictors.py` and the tests import `model_spaces`; then delete it."""

from .model_spaces import *  # noqa: F403  (the whole public API, by its __all__)
from .model_spaces import __all__  # noqa: F401
