"""Training a draft head: AdamW over the target's features, with one of two losses.

- "eagle" (EAGLE-1/2): the head's output regresses the target's next feature (smooth L1) plus
  0.1 x the cross-entropy of its distribution against the target's, one step ahead; uniform
  noise on the input features, as EAGLE adds.
- "ttt" (EAGLE-3's training-time test): the head is unrolled `unroll` steps as it drafts (step
  s reads its own output of step s - 1 and attends to the target-feature rows up to its anchor
  and to its own earlier steps), the loss the sum of 0.8^s x the cross-entropy at step s.

Labels are the target's own distribution over the head's vocabulary (its logits through the
frozen norm and head rows), on the answers' positions whose target argmax the head can draft.

Resume. Every `checkpoint_every` optimizer steps (and at the end) the weights, the optimizer's
state and the step go to a checkpoint file, written whole, fsynced, then renamed; one that cannot
be read (cut short, damaged) is refused, naming `--restart-training`. The batch order and the
noise are functions of (seed, epoch) and (seed, step), never of a generator's running state, so
a run resumed from a checkpoint computes what the uninterrupted run did, bit for bit.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specdecode.drafters.head import DraftHead
from specdecode.errors import InvalidArgumentError
from specdecode.training.features import Example

LOSSES = ("ttt", "eagle")
CHECKPOINT = "checkpoint.pt"  # in train-draft's --output
# how a refusal of a checkpoint says to discard it alone
RESTART_TRAINING = "--restart-training to discard it and train afresh on the data already made"
STEP_DECAY = 0.8  # EAGLE-3's weight of the s-th unrolled step: 0.8^s


@dataclass(frozen=True)
class TrainConfig:
    loss: str = "ttt"
    unroll: int = 3  # ttt: draft steps unrolled
    epochs: int = 4
    lr: float = 5e-4
    batch: int = 4  # samples per optimizer step
    clip: float = 0.5
    noise: float = 0.2  # eagle: uniform noise of this width on the input features
    seed: int = 0
    checkpoint_every: int = 50  # optimizer steps

    def __post_init__(self) -> None:
        if self.loss not in LOSSES:
            raise InvalidArgumentError(f"unknown loss '{self.loss}'; choose one of: {', '.join(LOSSES)}", "loss")
        for name in ("unroll", "epochs", "batch", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise InvalidArgumentError(f"{name} must be >= 1, got {getattr(self, name)}", name)


@dataclass
class TrainState:
    step: int = 0  # optimizer steps done
    losses: list[float] | None = None  # mean loss of each step done
    resumed_from: int | None = None  # the step a resumed run started at


def train(
    head: DraftHead,
    examples: list[Example],
    config: TrainConfig,
    checkpoint: Path | None = None,
    on_step: Callable[[int, int, float], None] | None = None,
) -> TrainState:
    """Train head in place; on_step(step, total, loss) after each optimizer step. A checkpoint
    that exists is resumed from (module docstring)."""
    if not examples:
        raise InvalidArgumentError("no training examples: generate more samples", "samples")
    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, betas=(0.9, 0.95), weight_decay=0.0)
    per_epoch = math.ceil(len(examples) / config.batch)
    total = config.epochs * per_epoch
    state = _resume(head, optimizer, checkpoint, config)
    head.train()
    for step in range(state.step, total):
        epoch, index = divmod(step, per_epoch)
        order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(config.seed * 100_003 + epoch))
        batch = order[index * config.batch : (index + 1) * config.batch].tolist()
        optimizer.zero_grad(set_to_none=True)
        noise = torch.Generator().manual_seed(config.seed * 1_000_003 + step)
        loss_sum = 0.0
        for i in batch:
            loss = example_loss(head, examples[i], config, noise) / len(batch)
            loss.backward()
            loss_sum += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(params, config.clip)
        optimizer.step()
        state.step, state.losses = step + 1, (state.losses or []) + [loss_sum]
        if checkpoint is not None and (state.step % config.checkpoint_every == 0 or state.step == total):
            _save_checkpoint(head, optimizer, state, config, checkpoint)
        if on_step is not None:
            on_step(state.step, total, loss_sum)
    head.eval()
    return state


def example_loss(head: DraftHead, example: Example, config: TrainConfig, noise: torch.Generator) -> torch.Tensor:
    features = example.features.float()  # [T, layers, hidden]
    if config.loss == "eagle" and config.noise > 0:
        features = features + (torch.rand(features.shape, generator=noise) - 0.5) * config.noise
    tokens, n = example.tokens, example.tokens.shape[0] - 1  # rows j = 0 .. T - 2
    labels = _soft_labels(head, example)  # [T, draft vocab], the target's distribution after each position
    rows = torch.arange(n)
    g, keys, values = head(head.features(features[:n]), tokens[1:], rows, None, None)  # g_j predicts token j + 2
    useful = _useful(head, example)  # [T]
    if config.loss == "eagle":
        mask = useful[1:]
        feature_loss = F.smooth_l1_loss(g[mask], example.last[1:][mask].float()) if mask.any() else g.sum() * 0
        return feature_loss + 0.1 * _cross_entropy(head.logits(g), labels[1:], mask)
    total = _cross_entropy(head.logits(g), labels[1:], useful[1:])
    past_keys, past_values = [keys], [values]
    for s in range(1, config.unroll):
        # step s, anchor j: token j + 1 + s after the head's own output, at position j + s
        ahead = torch.arange(n) + 1 + s  # [n], the position of each row's token
        valid = ahead <= n
        step_tokens = torch.where(valid, tokens[ahead.clamp(max=n)], 0)
        mask = torch.cat([torch.ones(n, n, dtype=torch.bool).tril()] + [torch.eye(n, dtype=torch.bool)] * s, dim=1)
        past = (torch.cat(past_keys, dim=1), torch.cat(past_values, dim=1))
        g, keys, values = head(g, step_tokens, rows + s, past, mask)
        past_keys.append(keys)
        past_values.append(values)
        mask_loss = valid & useful[ahead.clamp(max=n)]
        total = total + STEP_DECAY**s * _cross_entropy(head.logits(g), labels[ahead.clamp(max=n)], mask_loss)
    return total


def _soft_labels(head: DraftHead, example: Example) -> torch.Tensor:  # [T, draft vocab]
    with torch.no_grad():
        return torch.softmax(head.logits(example.last.float()), dim=-1)


def _useful(head: DraftHead, example: Example) -> torch.Tensor:  # [T] bool
    """Positions whose next token the head should learn: in the answer (the distribution after
    the last prompt token onward), with the target's argmax in the head's vocabulary."""
    positions = torch.arange(example.tokens.shape[0])
    return (positions >= example.answer_start - 1) & torch.isin(example.argmax, head.vocabulary)


def _cross_entropy(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over the masked rows of -sum(labels * log_softmax(logits)); 0 (with a graph) if none."""
    if not mask.any():
        return logits.sum() * 0
    return -(labels[mask] * torch.log_softmax(logits[mask], dim=-1)).sum(-1).mean()


def _save_checkpoint(head, optimizer, state: TrainState, config: TrainConfig, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = _partial(path)
    with partial.open("wb") as file:
        torch.save(
            {
                "head": head.state_dict(),
                "optimizer": optimizer.state_dict(),
                "state": asdict(state),
                "config": asdict(config),
                "head_setup": _head_setup(head),
            },
            file,
        )
        file.flush()
        os.fsync(file.fileno())  # on disk before the rename: a lost machine never finds the new name on half a file
    os.replace(partial, path)  # whole or not at all: an interruption while writing keeps the last one


def _partial(path: Path) -> Path:
    return path.with_suffix(".partial")


def discard_checkpoint(path: Path) -> None:
    """--restart-training (and --restart): the checkpoint, and one an interruption left half written."""
    path.unlink(missing_ok=True)
    _partial(path).unlink(missing_ok=True)


def _head_setup(head: DraftHead) -> dict:
    """What decides the shapes and meaning of the head's weights: its architecture (not how it
    was trained) and the target tokens its outputs stand for."""
    config = {k: v for k, v in asdict(head.config).items() if k != "training"}
    return config | {"feature_layers": list(head.config.feature_layers), "vocabulary": head.vocabulary.tolist()}


def _resume(head, optimizer, path: Path | None, config: TrainConfig) -> TrainState:
    if path is None or not path.is_file():
        return TrainState()
    saved = _load_checkpoint(path)
    if saved["config"] != asdict(config):
        raise InvalidArgumentError(
            f"the checkpoint {path} was written by another training setup ({saved['config']}): "
            f"give the same options, {RESTART_TRAINING}, or another --output",
            "output",
        )
    setup = saved.get("head_setup")  # absent from checkpoints written before it was recorded
    if setup is not None and setup != _head_setup(head):
        raise InvalidArgumentError(
            f"the checkpoint {path} trains a head of another shape or vocabulary (--vocab-size, --features, "
            f"or other data) than this run's: give the same options and data, {RESTART_TRAINING}, or another --output",
            "output",
        )
    head.load_state_dict(saved["head"])
    optimizer.load_state_dict(saved["optimizer"])
    state = TrainState(**saved["state"])
    state.resumed_from = state.step
    return state


def _load_checkpoint(path: Path) -> dict:
    """The checkpoint's contents. A file that is not one (cut short by a full disk or a crash,
    damaged, or another file) is refused in one line: torch.load's errors then are many (the zip
    reader's RuntimeError, EOFError, the unpickler's), and none says what to do."""
    try:
        saved = torch.load(path, weights_only=True)
    except OSError as error:  # not the file's contents: discarding it would not help
        raise InvalidArgumentError(f"the checkpoint {path} cannot be opened: {error.strerror}", "output") from None
    except Exception:
        saved = None
    if not isinstance(saved, dict) or not all(key in saved for key in ("head", "optimizer", "state", "config")):
        raise InvalidArgumentError(
            f"the checkpoint {path} cannot be read (cut short or damaged): rerun with {RESTART_TRAINING}",
            "output",
        )
    return saved
