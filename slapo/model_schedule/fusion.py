"""The `fuse` knob: trace each MLP by need, expose its bias add, fuse bias+activation.

Per family, the MLP's leaves (kept as modules, so TP shards on them stay valid), the layer
whose bias is split off (`decompose`), and the pattern to fuse:

- GPT-2 / GPT-Neo: `NewGELUActivation()(x + b)` after `c_fc`;
- BERT / RoBERTa: `F.gelu(x + b)` after `intermediate.dense`;
- LLaMA family: `F.silu(gate) * up` (SwiGLU) — no bias, so nothing to decompose.
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


# family -> (leaves of the MLP, layer to decompose or None, pattern)
PLANS = {
    "gpt2": (["c_fc", "c_proj"], "c_fc", _new_gelu_bias),
    "gpt_neo": (["c_fc", "c_proj"], "c_fc", _new_gelu_bias),
    "bert": (["dense"], "dense", _gelu_bias),
    "roberta": (["dense"], "dense", _gelu_bias),
    "llama": (["gate_proj", "up_proj", "down_proj"], None, _swiglu),
}


def fuse_mlp(mlp: Schedule, family: str, compiler: str = "inductor") -> Schedule:
    """Trace `mlp` (leaves kept), decompose the bias, fuse the activation pattern."""
    if family not in PLANS:
        raise SchedulingError(mlp.path, f"no fusion plan for the {family} family.",
                              f"fuse=True supports {', '.join(sorted(PLANS))}.")
    leaves, decompose, pattern = PLANS[family]
    mlp.trace(leaves=leaves, flatten=True)
    if decompose is not None:
        mlp[decompose].decompose()
    matches = mlp.find(pattern)
    return mlp.fuse(matches[0], compiler=compiler, name="fused_act")
