"""`slapo train`: the training loop behind the command line (see `slapo.cli`)."""

from .loop import TrainConfig, train
from .models import MODELS, ModelSize, build_model
from .pretrained import ModelSource, load_weights, model_source

__all__ = ["MODELS", "ModelSize", "ModelSource", "TrainConfig", "build_model", "load_weights",
           "model_source", "train"]
