"""`slapo train`: the training loop behind the command line (see `slapo.cli`).

Modules, one concern each: `config` (TrainConfig), `setup` (Env, mesh), `assemble` (Run, build),
`loop` (the steps), `resume`, `report`, `run_state` (save, verify, load a run checkpoint;
`checkpoints`: its layout, `run_owner`: run ids, `checkpoint_read`: safe DCP reading, `run_rng`:
RNG files), `faults` (who failed; `stop_signals`: Ctrl-C and SIGTERM; `fault_injection`: the
`SLAPO_FAULT` test hook), `models` (registry), `pretrained` (`--model DIR`), `demo`
(`--progressive`).
"""

from .config import TrainConfig
from .loop import train
from .models import MODELS, MOE_MODELS, ModelSize, build_model
from .pretrained import ModelSource, load_weights, model_source

__all__ = ["MODELS", "MOE_MODELS", "ModelSize", "ModelSource", "TrainConfig", "build_model",
           "load_weights", "model_source", "train"]
