"""`specdecode train-draft`: data, features, training and a held-out summary, in one command.

Everything it writes goes to --output: the data, chunk by chunk, and data.jsonl (datafiles.py:
a rerun goes on where an interrupted one stopped), the target's features, chunk by chunk
(featurefiles.py, resumed the same way), checkpoint.pt (trainer.py), the head
(config.json, head.safetensors, vocabulary.json) and summary.json. Run again with the same
options after an interruption, it ends with the data and the weights of an uninterrupted run;
--restart discards what an earlier run left, --restart-training only its checkpoint.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Optional

import torch
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from specdecode.drafters.head import DraftHead, eagle3_layers, head_config, new_head, save_head
from specdecode.engine import SpeculativeEngine
from specdecode.errors import InvalidArgumentError
from specdecode.loading import DEFAULT_TARGET
from specdecode.progress import LoggedProgress
from specdecode.training import data, datafiles, featurefiles, trainer
from specdecode.training.evaluate import HELD_OUT, held_out_acceptance
from specdecode.training.trainer import TrainConfig, train

FEATURES = ("last", "eagle3")  # the last layer's output; or entering layers 2, L/2, L - 3


def train_draft(
    target: str | SpeculativeEngine,
    output: str | Path,
    samples: int = 300,
    prompts: str | Path | None = None,
    vocab_size: int = 4096,
    features: str = "last",
    config: TrainConfig | None = None,
    max_new_tokens: int = 192,
    max_length: int = 512,
    held_out: list[str] | None = None,
    k: int = 4,
    dtype: str = "auto",
    progress: bool = True,
    restart: bool = False,
    restart_training: bool = False,
    input_norms: bool = True,
) -> dict:
    """Train a draft head for target and save it in output; returns the summary (also in
    output/summary.json). prompts: a JSONL file of prompts (else Magpie instructions the
    target writes); held_out: the prompts acceptance is measured on (default evaluate.HELD_OUT);
    restart: discard the data and checkpoint an earlier run left in output; restart_training: the
    checkpoint alone (a damaged one, or one of other training options), keeping the data;
    input_norms: HeadConfig's."""
    config = config or TrainConfig()
    if features not in FEATURES:
        raise InvalidArgumentError(f"unknown features '{features}'; choose one of: {', '.join(FEATURES)}", "features")
    if samples < 1 or vocab_size < 2:
        raise InvalidArgumentError(
            "samples must be >= 1 and vocab_size >= 2", "samples" if samples < 1 else "vocab_size"
        )
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    if restart_training:
        trainer.discard_checkpoint(output / trainer.CHECKPOINT)
    held_out = HELD_OUT if held_out is None else held_out
    console = Console(stderr=True, quiet=not progress)
    engine = target if isinstance(target, SpeculativeEngine) else _engine(target, dtype)
    model = engine.target_runner.model
    timings: dict[str, float] = {}
    with _bars(console) as bars:
        start = time.perf_counter()
        settings = datafiles.data_settings(
            engine, samples, prompts, held_out, config.seed, max_new_tokens, _chat(engine)
        )
        chosen = datafiles.make_data(engine, output, settings, prompts, held_out, bars, restart)
        timings["data_s"] = time.perf_counter() - start
        vocabulary = data.draft_vocabulary(chosen, vocab_size, engine.eos_token_ids)
        layers = _layers(model, features)
        name = target if isinstance(target, str) else None  # the head's config names its target in messages
        head = new_head(model, head_config(model, layers, len(vocabulary), name, input_norms), vocabulary, config.seed)
        start = time.perf_counter()
        task = bars.add_task("target features", total=len(chosen))
        identity = [settings.target, settings.dtype, settings.runner]
        progress = lambda i: bars.update(task, completed=i)  # noqa: E731
        examples = featurefiles.collect_in(output, engine.target_runner, chosen, layers, max_length, identity, progress)
        timings["features_s"] = time.perf_counter() - start
        start = time.perf_counter()
        task = bars.add_task(f"training ({config.loss})", total=None)

        def on_step(step: int, total: int, loss: float) -> None:
            bars.update(task, completed=step, total=total, description=f"training ({config.loss}, loss {loss:.3f})")

        state = train(head, examples, config, output / trainer.CHECKPOINT, on_step)
        timings["training_s"] = time.perf_counter() - start
    head.config.training.update(_training_record(config, features, chosen, state))
    save_head(head, output)
    acceptance = held_out_acceptance(engine, head, held_out, k=k, chat=_chat(engine))
    summary = {
        "target": target if isinstance(target, str) else None,
        "samples": len(chosen),
        "tokens": sum(len(s.answer_ids) for s in chosen),
        "vocab_size": len(vocabulary),
        "features": features,
        "train": head.config.training,
        "seconds": {name: round(value, 1) for name, value in timings.items()},
        "held_out": acceptance.line(),
        "tokens_per_forward": round(acceptance.tokens_per_forward, 3),
    }
    (output / "summary.json").write_text(json.dumps(summary, indent=2))
    console.print(f"[bold]head saved in {output}[/]: held-out {acceptance.line()}")
    return summary


def _engine(target: str, dtype: str) -> SpeculativeEngine:
    # the features pass and the head's frozen parts read the transformers model: keep its weights
    return SpeculativeEngine.from_pretrained(target, drafter="none", dtype=dtype, keep_model_weights=True)


def _chat(engine: SpeculativeEngine) -> bool:
    return bool(engine.tokenizer is not None and getattr(engine.tokenizer, "chat_template", None))


def _layers(model, features: str) -> tuple[int, ...]:
    layers = model.config.get_text_config().num_hidden_layers
    return (layers,) if features == "last" else eagle3_layers(layers)


def _training_record(config: TrainConfig, features: str, samples: list[data.Sample], state) -> dict:
    return {
        "loss": config.loss,
        "unroll": config.unroll if config.loss == "ttt" else 1,
        "epochs": config.epochs,
        "lr": config.lr,
        "batch": config.batch,
        "seed": config.seed,
        "steps": state.step,
        "final_loss": round(sum(state.losses[-10:]) / len(state.losses[-10:]), 4) if state.losses else None,
        "features": features,
        "samples": len(samples),
    }


@contextmanager
def _bars(console: Console):
    bars = LoggedProgress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        disable=console.quiet,
    )
    with bars:
        yield bars


def train_draft_command(
    output: Annotated[str, typer.Option(help="Folder for the head, its data, checkpoint and summary.")],
    target: Annotated[str, typer.Option(help="Target model: short name, folder, .gguf file or Hub id.")] = (
        DEFAULT_TARGET
    ),
    samples: Annotated[
        int,
        typer.Option(help="Training samples: the target's answers, greedy and sampled, to half as many instructions."),
    ] = 300,
    prompts: Annotated[
        Optional[str], typer.Option(help='A JSONL file of prompts ({"prompt": ...}) \\[default: Magpie].')
    ] = None,
    vocab_size: Annotated[int, typer.Option(help="Tokens the head drafts from (the most frequent).")] = 4096,
    features: Annotated[str, typer.Option(help="last (the last layer) or eagle3 (low, middle, high).")] = "last",
    input_norms: Annotated[
        bool,
        typer.Option(help="RMS norms on the head's token embedding and features before it mixes them (EAGLE-3's)."),
    ] = True,
    loss: Annotated[str, typer.Option(help="ttt (EAGLE-3's training-time test) or eagle (EAGLE-1).")] = "ttt",
    unroll: Annotated[int, typer.Option(help="ttt: draft steps unrolled in training.")] = 3,
    epochs: Annotated[int, typer.Option(help="Passes over the data.")] = 4,
    lr: Annotated[float, typer.Option(help="AdamW learning rate.")] = 5e-4,
    batch: Annotated[int, typer.Option(help="Samples per optimizer step.")] = 4,
    seed: Annotated[int, typer.Option(help="Seed of the data, the initial weights and the order.")] = 0,
    max_new_tokens: Annotated[int, typer.Option(help="Most tokens per answer.")] = 192,
    checkpoint_every: Annotated[int, typer.Option(help="Optimizer steps between checkpoints.")] = 50,
    dtype: Annotated[
        str, typer.Option(help="The target's dtype: auto, float32, bfloat16 or float16 (as generate's).")
    ] = "auto",
    restart: Annotated[
        bool, typer.Option(help="Discard the data and checkpoint an earlier run left in --output; start over.")
    ] = False,
    restart_training: Annotated[
        bool,
        typer.Option(
            help="Discard only the training checkpoint in --output (a damaged one, or one of other training "
            "options) and train afresh on the data there."
        ),
    ] = False,
) -> None:
    """Train a draft head (EAGLE-style) for a target: Magpie data, one target pass, training."""
    torch.manual_seed(seed)
    config = TrainConfig(loss, unroll, epochs, lr, batch, seed=seed, checkpoint_every=checkpoint_every)
    train_draft(
        target,
        output,
        samples,
        prompts,
        vocab_size,
        features,
        config,
        max_new_tokens,
        input_norms=input_norms,
        dtype=dtype,
        restart=restart,
        restart_training=restart_training,
    )


__all__ = ["DraftHead", "train_draft", "train_draft_command"]
