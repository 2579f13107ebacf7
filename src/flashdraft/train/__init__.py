"""Drafter training: `flashdraft train-drafter` (cli), the pipeline (trainer), data, blocks and held-out tau."""
from flashdraft.train.evaluate import measure_tau
from flashdraft.train.trainer import TrainConfig, train_drafter

__all__ = ["TrainConfig", "measure_tau", "train_drafter"]
