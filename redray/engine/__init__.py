"""Trainer and Predictor: run inside one process on all its devices (no Ray needed)."""

from redray.engine.hooks import Hook
from redray.engine.load import load_model, load_params
from redray.engine.model import LinenModel
from redray.engine.nonfinite import NonFiniteError
from redray.engine.predictor import Predictor
from redray.engine.schedule import Schedule
from redray.engine.settings import DataSettings, PlanSettings, ReportSettings, StepSettings
from redray.engine.trainer import Trainer

__all__ = ["DataSettings", "Hook", "LinenModel", "NonFiniteError", "PlanSettings", "Predictor",
           "ReportSettings", "Schedule", "StepSettings", "Trainer", "load_model",
           "load_params"]
