"""Trainer and Predictor: run inside one process on all its devices (no Ray needed)."""

from redray.engine.model import LinenModel
from redray.engine.predictor import Predictor
from redray.engine.trainer import Trainer

__all__ = ["LinenModel", "Predictor", "Trainer"]
