"""Per-GPU memory of model states and pipeline stages (closed forms, numpy-vectorisable).

Kept separate from the traced activation model because these terms do not depend on the block's
code, only on parameter counts and the parallel layout — the same accounting as Mist's
`full_weights / full_grads / full_opts` divided by the ZeRO sharding degree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

_OPT_STATE_BYTES = {"adam": 8, "adamw": 8, "sgd": 4, "none": 0}  # fp32 moments per parameter


@dataclass
class ModelStates:
    """Bytes of weights, gradients and optimizer state resident on one GPU."""

    weights: Any
    grads: Any
    optimizer: Any

    @property
    def total(self) -> Any:
        return self.weights + self.grads + self.optimizer


def model_state_bytes(num_params: Any, *, tp: Any = 1, dp: Any = 1, zero: Any = 0,
                      param_bytes: int = 2, grad_bytes: int | None = None,
                      optimizer: str = "adam", master_weights: bool | None = None,
                      replicated_params: Any = 0) -> ModelStates:
    """Model-state bytes per GPU under TP and DP with ZeRO stage `zero` (FSDP = ZeRO-3).

    `num_params` is the parameter count of what this GPU's pipeline stage holds (before TP);
    `replicated_params` of them (LayerNorm weights, row-parallel biases) are not split by TP.
    Mixed precision (`param_bytes` < 4) keeps an fp32 master copy by default. ZeRO-1 shards
    the optimizer state (incl. master weights) over `dp`, ZeRO-2 also the gradients, ZeRO-3
    also the weights. Works elementwise on numpy arrays.
    """
    opt = optimizer.lower()
    if opt not in _OPT_STATE_BYTES:
        raise ValueError(f"optimizer {optimizer!r} unknown; use one of {sorted(_OPT_STATE_BYTES)}.")
    zero_arr = np.asarray(zero)
    if np.any((zero_arr < 0) | (zero_arr > 3)):
        raise ValueError(f"zero stage must be 0..3, got {zero!r}.")
    grad_bytes = param_bytes if grad_bytes is None else grad_bytes
    master = (param_bytes < 4) if master_weights is None else master_weights
    per_rank = replicated_params + (num_params - replicated_params) / tp
    opt_bytes = _OPT_STATE_BYTES[opt] + (4 if master else 0)
    shard = lambda stage: np.where(zero_arr >= stage, dp, 1)  # noqa: E731
    return ModelStates(
        weights=per_rank * param_bytes / shard(3),
        grads=per_rank * grad_bytes / shard(2),
        optimizer=per_rank * opt_bytes / shard(1),
    )


def pipeline_inflight(stage: Any, pp: Any, num_microbatches: Any) -> Any:
    """Micro-batches whose activations stage `stage` (0-based) holds at its 1F1B peak.

    Under 1F1B stage i runs pp - i forwards before its first backward, so it keeps
    min(pp - i, num_microbatches) micro-batches of saved activations.
    """
    stage, pp, g = np.asarray(stage), np.asarray(pp), np.asarray(num_microbatches)
    if np.any(stage < 0) or np.any(stage >= pp):
        raise ValueError(f"stage must be in [0, pp), got stage={stage!r}, pp={pp!r}.")
    return np.minimum(pp - stage, g)


def stage_peak_bytes(*, states: Any, layers: Any, ckpt_layers: Any, saved_per_layer: Any,
                     input_per_layer: Any, stage: Any = 0, pp: Any = 1, num_microbatches: Any = 1,
                     extra_activation: Any = 0, transient: Any = 0) -> Any:
    """Peak memory of one pipeline stage under 1F1B.

    Per micro-batch a non-checkpointed layer keeps `saved_per_layer` (its saved tensors
    *including* its input) and a checkpointed one only `input_per_layer`. The stage holds
    `pipeline_inflight` micro-batches, plus — when any layer is checkpointed — one layer's
    full saved set re-materialised during its backward, plus `transient` (the largest
    temporary of one op, e.g. the attention-score softmax) and `extra_activation` per
    micro-batch (embedding / head of the first / last stage).
    """
    layers, ckpt = np.asarray(layers), np.asarray(ckpt_layers)
    if np.any(ckpt > layers) or np.any(ckpt < 0):
        raise ValueError("ckpt_layers must be between 0 and layers.")
    per_mb = (layers - ckpt) * saved_per_layer + ckpt * input_per_layer + extra_activation
    recompute = np.where(ckpt > 0, saved_per_layer, 0)
    return states + pipeline_inflight(stage, pp, num_microbatches) * per_mb + recompute + transient
