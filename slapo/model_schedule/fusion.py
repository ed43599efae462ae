"""The `fuse` knob: trace each MLP by need, expose its bias add, fuse bias+activation.

Per family, the MLP's leaves (kept as modules, so TP shards on them stay valid), the layer
whose bias is split off (`decompose`), and the pattern to fuse:

- GPT-2 / GPT-Neo: `NewGELUActivation()(x + b)` after `c_fc`;
- BERT / RoBERTa: `F.gelu(x + b)` after `intermediate.dense`;
- LLaMA family: `F.silu(gate) * up` (SwiGLU) — no bias, so nothing to decompose;
- T5 v1.1 (gated-GELU `DenseReluDense`: `wi_0`/`wi_1`): `NewGELUActivation()(gate) * up`, the
  tanh-GELU's ~8 elementwise ops and the gate multiply in one kernel. T5 v1's `wi` -> ReLU has
  no bias and a single activation op, so there is nothing to fuse: it has no plan (rejected).
"""

from __future__ import annotations

import torch.nn.functional as F

from ..errors import SchedulingError
from ..schedule import Schedule


def _new_gelu_bias(x, b):
    from transformers.activations import NewGELUActivation

    return NewGELUActivation()(x + b)


def _gelu_bias(x, b):
    return F.gelu(x + b)


def _swiglu(gate, up):
    return F.silu(gate) * up


def _gated_new_gelu(gate, up):
    from transformers.activations import NewGELUActivation

    return NewGELUActivation()(gate) * up


# family -> (leaves of the MLP, layer to decompose or None, pattern)
PLANS = {
    "gpt2": (["c_fc", "c_proj"], "c_fc", _new_gelu_bias),
    "gpt_neo": (["c_fc", "c_proj"], "c_fc", _new_gelu_bias),
    "bert": (["dense"], "dense", _gelu_bias),
    "roberta": (["dense"], "dense", _gelu_bias),
    "llama": (["gate_proj", "up_proj", "down_proj"], None, _swiglu),
    "t5": (["wi_0", "wi_1", "wo"], None, _gated_new_gelu),
}


def unfusable(mlp: Schedule, family: str) -> str | None:
    """Why `mlp` does not have the layout the family's plan fuses (None: it does), checked on
    every MLP before any of them is traced, so a rejected `fuse` leaves the model untouched."""
    if family not in PLANS:
        return f"no fusion plan for the {family} family"
    missing = [leaf for leaf in PLANS[family][0] if leaf not in mlp.child]
    if not missing:
        return None
    if family == "t5":
        return ("no fusion plan for the t5 family's ReLU `DenseReluDense` (no bias and one "
                "activation op: nothing to fuse; gated-GELU T5 v1.1 configs are fused)")
    return f"{mlp.path} lacks {missing}, which the {family} fusion plan expects"


def fuse_mlp(mlp: Schedule, family: str, compiler: str = "inductor") -> Schedule:
    """Trace `mlp` (leaves kept), decompose the bias, fuse the activation pattern."""
    reason = unfusable(mlp, family)
    if reason is not None:
        raise SchedulingError(mlp.path, f"{reason}.", f"fuse=True supports "
                              f"{', '.join(sorted(PLANS))}; pass fuse=False.")
    leaves, decompose, pattern = PLANS[family]
    mlp.trace(leaves=leaves, flatten=True)
    if decompose is not None:
        mlp[decompose].decompose()
    matches = mlp.find(pattern)
    return mlp.fuse(matches[0], compiler=compiler, name="fused_act")
