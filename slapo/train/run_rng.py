"""Every RNG stream of a rank as JSON (torch, CUDA, python, numpy, Slapo's TP stream): saved
with each run checkpoint (`rng_rank{r}.json`) and restored on resume; data only, no pickle."""

from __future__ import annotations

import base64
import random
from pathlib import Path
from typing import Any

import torch

from .checkpoints import CheckpointError, read_json


def _bytes_to_json(t: torch.Tensor) -> str:
    return base64.b64encode(bytes(t.to(torch.uint8).reshape(-1).tolist())).decode("ascii")


def _bytes_from_json(text: str) -> torch.Tensor:
    return torch.tensor(list(base64.b64decode(text, validate=True)), dtype=torch.uint8)


def rng_state() -> dict[str, Any]:
    """Every RNG stream of this process as JSON-able data (byte states base64-encoded)."""
    from ..distributed.rng import get_rng_tracker

    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": _bytes_to_json(torch.get_rng_state()),
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss},
        "slapo_tracker": {name: [_bytes_to_json(cpu), None if cuda is None
                                 else _bytes_to_json(cuda)]
                          for name, (cpu, cuda) in get_rng_tracker().get_states().items()},
    }
    if torch.cuda.is_available():
        state["cuda"] = [_bytes_to_json(s) for s in torch.cuda.get_rng_state_all()]
    try:
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = {"kind": kind, "keys": [int(k) for k in keys], "pos": int(pos),
                          "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    except ImportError:  # pragma: no cover
        pass
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` returned (raises KeyError/TypeError/ValueError on bad data)."""
    from ..distributed.rng import get_rng_tracker

    torch.set_rng_state(_bytes_from_json(state["torch"]))
    py = state["python"]
    random.setstate((int(py["version"]), tuple(int(x) for x in py["internal"]),
                     None if py["gauss_next"] is None else float(py["gauss_next"])))
    get_rng_tracker().set_states({
        str(name): (_bytes_from_json(cpu), None if cuda is None else _bytes_from_json(cuda))
        for name, (cpu, cuda) in state["slapo_tracker"].items()})
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_bytes_from_json(s) for s in state["cuda"]])
    if "numpy" in state:
        import numpy as np

        n = state["numpy"]
        np.random.set_state((str(n["kind"]), np.array(n["keys"], dtype=np.uint32),
                             int(n["pos"]), int(n["has_gauss"]), float(n["cached_gaussian"])))


def load_rng(path: Path) -> None:
    """Restore this rank's RNG streams from its JSON file, naming the file on bad data."""
    state = read_json(path)
    try:
        set_rng_state(state)
    except (KeyError, TypeError, ValueError, RuntimeError, AttributeError) as e:
        raise CheckpointError(path, f"not a valid RNG state ({type(e).__name__}: {e})") from None
