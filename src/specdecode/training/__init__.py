"""Training a draft head for a target (`specdecode train-draft`): data (data.py), the target's
features (features.py), training (trainer.py), held-out acceptance (evaluate.py)."""

from specdecode.training.command import train_draft, train_draft_command
from specdecode.training.trainer import TrainConfig

__all__ = ["TrainConfig", "train_draft", "train_draft_command"]
