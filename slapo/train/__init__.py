"""`slapo train`: the training loop behind the command line (see `slapo.cli`)."""

from .loop import TrainConfig, train
from .models import MODELS, ModelSize, build_model

__all__ = ["MODELS", "ModelSize", "TrainConfig", "build_model", "train"]
