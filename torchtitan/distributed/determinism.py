"""The run's seed and deterministic algorithms (training.seed, training.deterministic)."""

import os

import torch


def set_determinism(seed: int, deterministic: bool):
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
