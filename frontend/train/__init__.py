"""kiln.train: the Learner (captured steps, evaluation, metrics, progress, early stopping, gradient accumulation,
exact checkpoint-resume) and the data loading it reads."""

from .checkpoint import Checkpointing
from .data import ArrayDataset, DataLoader, Dataset
from .learner import EarlyStopping, Learner
from .metrics import Accuracy, LearningRate, Loss, Metric, SamplesPerSecond, StepOutput, StepTime, TopK

__all__ = ["Accuracy", "ArrayDataset", "Checkpointing", "DataLoader", "Dataset", "EarlyStopping", "Learner",
           "LearningRate", "Loss", "Metric", "SamplesPerSecond", "StepOutput", "StepTime", "TopK"]
