"""`slapo train`: the training loop behind the command line (see `slapo.cli`).

Modules, one concern each: `config` (TrainConfig), `setup` (Env, mesh), `assemble` (Run, build),
`loop` (the steps), `resume`, `report`, `run_state` (checkpoint format), `models` (registry),
`pretrained` (`--model DIR`), `demo` (`--progressive`).
"""

from .config import TrainConfig
from .loop import train
from .models import MODELS, ModelSize, build_model
from .pretrained import ModelSource, load_weights, model_source

__all__ = ["MODELS", "ModelSize", "ModelSource", "TrainConfig", "build_model", "load_weights",
           "model_source", "train"]
