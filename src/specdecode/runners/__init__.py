"""Model execution: the runner protocol, transformers' runner, the fast paths and their cache."""

from specdecode.runners.base import ModelRunner
from specdecode.runners.cached import CachedSequence
from specdecode.runners.hf import HFModelRunner
from specdecode.runners.select import RUNNERS, runner_for

__all__ = ["RUNNERS", "CachedSequence", "HFModelRunner", "ModelRunner", "runner_for"]
