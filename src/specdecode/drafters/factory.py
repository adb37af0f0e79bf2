"""Build a drafter from its name (the CLI's and from_pretrained's `drafter` argument)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specdecode import precision
from specdecode.cache import DraftStore
from specdecode.drafters.auto import AutoDrafter
from specdecode.drafters.base import Drafter
from specdecode.drafters.cross_tokenizer import CrossTokenizerDrafter
from specdecode.drafters.head import HeadDrafter, is_head_folder, load_head, shipped_head
from specdecode.drafters.model import ModelDrafter
from specdecode.drafters.prompt_lookup import PromptLookupDrafter
from specdecode.drafters.recycling import RecyclingDrafter
from specdecode.drafters.self_quantized import self_quantized_drafter
from specdecode.drafters.suffix import SuffixDrafter
from specdecode.errors import InvalidArgumentError, VocabularyMismatchError
from specdecode.loading import check_same_vocabulary
from specdecode.runners import ModelRunner, runner_for
from specdecode.runners.projection import CodedEmbedding

DRAFTERS = (
    "auto",
    "model",
    "prompt-lookup",
    "recycling",
    "suffix",
    "self-quantized",
    "cross-tokenizer",
    "head",
    "none",
)

Loader = Callable[[str], tuple[PreTrainedModel, PreTrainedTokenizerBase]]


@dataclass(frozen=True)
class DrafterOptions:
    """How a drafter named in from_pretrained (or the CLI) is built."""

    adaptive: bool = True  # choose k <= num_speculative_tokens (k) per step from measurements (core/adaptive.py)
    min_ngram: int = 1  # prompt lookup: shortest n-gram matched
    max_ngram: int = 3  # prompt lookup: longest n-gram matched, tried first
    max_continuation: int | None = None  # prompt lookup: most tokens copied per step (None: k)
    lookup_history: bool = False  # prompt lookup also searches earlier requests' text
    # self-quantized only: "bfloat16", "int8-weight-only", "nf4" or "fp4" (bitsandbytes); None: bfloat16
    draft_quantization: str | None = None
    min_confidence: float = 0.0  # model drafters stop after a token they give less probability
    recycling_width: int = 8  # recycling: the target's candidates kept per token
    shipped_head: bool = True  # auto without a draft: draft with the head shipped for the target, if one


def verifies_trees(target: ModelRunner) -> bool:
    """Whether target verifies a tree of drafts in one forward (else it runs the first path)."""
    return bool(getattr(target, "verifies_trees", False))


def check_drafter_options(name: str, options: DrafterOptions) -> None:
    """An option that does not apply to the chosen drafter is an error, not silently ignored."""
    width = options.recycling_width
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise InvalidArgumentError(f"recycling_width must be an integer >= 1, got {width!r}", "recycling_width")
    if not options.shipped_head and name != "auto":
        raise InvalidArgumentError(
            f"--no-shipped-head applies to drafter 'auto' only, not to '{name}' (which drafts with no shipped head)",
            "shipped_head",
        )
    if options.draft_quantization is None:
        return
    if name != "self-quantized":
        raise InvalidArgumentError(
            f"--draft-quantization applies to the self-quantized drafter only, not to '{name}' "
            "(--quantization quantizes the target)",
            "draft_quantization",
        )
    precision.draft_precision_named(options.draft_quantization)  # raises for an unknown name


def check_drafter_name(name: str, draft: object) -> None:
    if name not in DRAFTERS:
        raise InvalidArgumentError(f"unknown drafter '{name}'; choose one of: {', '.join(DRAFTERS)}", "drafter")
    if name in ("model", "cross-tokenizer") and draft is None:
        raise InvalidArgumentError(
            f"drafter '{name}' needs a draft model: pass draft=NAME (--draft in the CLI)", "draft"
        )
    if name == "head" and draft is None:
        raise InvalidArgumentError(
            "drafter 'head' needs a draft head folder: pass draft=DIR (--draft; specdecode train-draft makes one)",
            "draft",
        )


def make_drafter(
    name: str,
    draft: str | Path | PreTrainedModel | None,
    target: ModelRunner,
    tokenizer: PreTrainedTokenizerBase | None,
    load: Loader,
    runner: str,
    options: DrafterOptions,
    store: DraftStore | None = None,
    heads: str | Path | None = None,
) -> Drafter | None:
    """The drafter `name` drafting for target (a runner with `.model`), draft loaded by `load`;
    store: the cross-request draft store, for `suffix` and `auto`; heads: the folder of shipped
    heads `auto` looks in (default: the package's, drafters.head.SHIPPED_HEADS)."""
    check_drafter_name(name, draft)
    check_drafter_options(name, options)
    if name == "none":
        return None
    trees = verifies_trees(target)
    if name == "prompt-lookup":
        return _lookup(options, tree=trees)
    if name == "recycling":
        return _recycling(target, options, trees)
    if name == "suffix":
        if store is None:
            raise InvalidArgumentError("drafter 'suffix' needs the draft store: leave draft_store on", "drafter")
        return SuffixDrafter(store)
    if name == "self-quantized":
        chosen = precision.draft_precision_named(options.draft_quantization)
        return self_quantized_drafter(target.model, chosen, options.min_confidence)
    given = _given_drafter(name, draft, target, tokenizer, load, runner, options, heads)
    return _auto(target, options, store, given) if name == "auto" else given


def _given_drafter(
    name: str,
    draft: str | Path | PreTrainedModel | None,
    target: ModelRunner,
    tokenizer: PreTrainedTokenizerBase | None,
    load: Loader,
    runner: str,
    options: DrafterOptions,
    heads: str | Path | None,
) -> Drafter | None:
    """The drafter of `draft`: a draft head's folder or a draft model; for `auto` without one,
    the head shipped for the target (unless options.shipped_head is off), if there is one."""
    if name == "head" and not is_head_folder(draft):
        raise InvalidArgumentError(
            f"{draft} is no draft head folder (config.json, head.safetensors, vocabulary.json): "
            "make one with specdecode train-draft --output DIR",
            "draft",
        )
    if name == "auto" and draft is None and options.shipped_head:
        draft = shipped_head(getattr(target, "model", None), heads)
    if name in ("head", "auto") and is_head_folder(draft):
        # the head reads the target's embedding, norm and head rows: before they are freed
        head = load_head(draft, target.model)
        embedding = getattr(target, "embedding", None)
        if isinstance(embedding, CodedEmbedding):  # the target frees its embedding matrix
            head.read_embeddings_from(embedding)
        return HeadDrafter(head, tree=verifies_trees(target))
    if draft is not None:
        return _draft_model_drafter(name, draft, target, tokenizer, load, runner, options)
    return None


def _auto(target: ModelRunner, options: DrafterOptions, store: DraftStore | None, given: Drafter | None) -> Drafter:
    """`auto`'s candidates. Each step the decoder tries them and the first that proposes drafts
    wins; with adaptive k each proposes only while it pays, and they are tried best first by the
    tokens per second each was measured to give (core/adaptive.py, "Ranking"), so that one that
    always proposes hides the others only while it pays most; the order below is the one they
    start in, and the one without adaptive k (seeded sampling). In order:
    - prompt lookup: only where the text repeats the prompt or itself (a tree if the target verifies trees);
    - the draft store (`suffix`): only where earlier requests' text continues this one;
    - the given drafter: a draft head (the folder given as draft, or the head shipped for the
      target) or a draft model;
    - where the target verifies trees, recycling (the target's own past predictions, prompt
      lookup's continuations first), which proposes wherever its table knows the last token,
      nearly every step: after a head, which drafts from the target's own hidden states;
      without one, first, with the others after it for seeded samples, which skip recycling
      (its table depends on history)."""
    trees = verifies_trees(target)
    store_drafter = SuffixDrafter(store) if store is not None else None
    lookup = _lookup(options, tree=trees)
    if not trees:
        candidates = [lookup, store_drafter, given]
    elif isinstance(given, HeadDrafter):
        candidates = [lookup, store_drafter, given, _recycling(target, options, trees)]
    else:
        candidates = [_recycling(target, options, trees), lookup, store_drafter, given]
    candidates = [c for c in candidates if c is not None]
    return AutoDrafter(candidates) if len(candidates) > 1 else candidates[0]


def _lookup(options: DrafterOptions, tree: bool) -> PromptLookupDrafter:
    return PromptLookupDrafter(
        options.min_ngram, options.max_ngram, options.max_continuation, options.lookup_history, tree=tree
    )


def _recycling(target: ModelRunner, options: DrafterOptions, tree: bool) -> RecyclingDrafter:
    """A table as wide as asked, after a tree prompt lookup (a chain one, and the table's chain,
    for a target that does not verify trees)."""
    return RecyclingDrafter(target.vocab_size, options.recycling_width, _lookup(options, tree), tree=tree)


def _draft_model_drafter(
    name: str,
    draft: str | PreTrainedModel,
    target: ModelRunner,
    tokenizer: PreTrainedTokenizerBase | None,
    load: Loader,
    runner: str,
    options: DrafterOptions,
) -> ModelDrafter | CrossTokenizerDrafter:
    """A "cross-tokenizer" drafter if asked for, else a "model" drafter with the target's tokenizer."""
    draft_model, draft_tokenizer = (draft, None) if isinstance(draft, PreTrainedModel) else load(draft)
    draft_runner = runner_for(draft_model.to(target.device), runner)
    if name == "cross-tokenizer":
        if tokenizer is None or draft_tokenizer is None:
            raise InvalidArgumentError("drafter 'cross-tokenizer' needs the target's and the draft's tokenizers")
        return CrossTokenizerDrafter(draft_runner, draft_tokenizer, tokenizer)
    try:
        check_same_vocabulary(tokenizer, draft_tokenizer, target.vocab_size, draft_runner.vocab_size)
    except VocabularyMismatchError as error:
        raise VocabularyMismatchError(f"{error}, or draft through text with drafter 'cross-tokenizer'") from None
    return ModelDrafter(draft_runner, options.min_confidence, tree=verifies_trees(target))


def drafter_identity(drafter: Drafter) -> list | None:
    """What decides a drafter's proposals, and so which random numbers a seeded sample draws:
    its class and what it declares (Drafter.cache_identity). The response cache keys seeded
    samples by it. None for a drafter that depends on history, or that cannot describe itself
    (its class does not define cache_identity: a subclass may propose otherwise than the class
    it extends): its seeded samples are not cached."""
    kind = type(drafter)
    if drafter.depends_on_history or "cache_identity" not in vars(kind):
        return None
    own = drafter.cache_identity()
    return None if own is None else [f"{kind.__module__}.{kind.__qualname__}", own]
