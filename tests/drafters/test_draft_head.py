"""The draft head (drafters/head.py) and its training (training/): a tiny target, a tiny head
trained in seconds inside the tests.

- training did something: a trained head's drafts are accepted more often than the untrained one's;
- greedy decoding with the head is transformers' own greedy output, drafts verified and kept
  (chains on transformers' runner; trees on the fast runner, where it keeps hidden states);
- sampling with the head's q (zero off its vocabulary) keeps the target's law (G-test), and a
  q that is not zero there is caught (negative control);
- a head with input norms gives the same logits whatever its features' scale (negative control:
  one without them does not), and a head saved before them loads without them;
- a head saved and loaded drafts the same; an interrupted training resumed from its checkpoint
  ends with bitwise the weights of an uninterrupted one (and another seed's differ); a damaged
  checkpoint is refused in one line naming --restart-training, and a checkpoint is fsynced
  before it replaces the last one;
- a head records its target's fingerprint (the same in float32 and bfloat16, and from a saved
  folder): `shipped_head` finds the head trained for the target and never another's, `auto`
  drafts with it (greedy output transformers' own, the head's drafts kept; before recycling
  on a target that verifies trees), `shipped_head=False` switches it off, and the response
  cache's drafter identity tells two heads apart.
"""

from __future__ import annotations

import copy
import io
import json
import os

import pytest
import torch
import transformers as T

from helpers import (
    ALPHA,
    DIST_VOCAB,
    GREEDY_PROMPTS,
    PROMPT,
    assert_drafted_and_accepted,
    exact_joint,
    g_test_pvalue,
    head64_llama,
    hf_greedy,
    nearby_draft,
    sample_counts,
    target_and_draft,
    tiny_gpt2,
    tiny_llama,
    tiny_tokenizer,
)
from specdecode import DrafterOptions, SpeculativeEngine
from specdecode.core.sampling import SamplingParams
from specdecode.drafters.base import Draft
from specdecode.drafters.factory import drafter_identity
from specdecode.drafters.head import (
    HEAD_CONFIG,
    HEAD_WEIGHTS,
    HeadCache,
    HeadDrafter,
    drafting_kind,
    for_drafting,
    head_config,
    is_head_folder,
    load_head,
    new_head,
    save_head,
    shipped_head,
    target_fingerprint,
)
from specdecode.drafters.head_kernel import attention_plan
from specdecode.errors import InvalidArgumentError
from specdecode.runners import HFModelRunner
from specdecode.runners.fast_llama import FastLlamaRunner
from specdecode.runners.fast_transformers import FastTransformersRunner
from specdecode.runners.projection import int8_supported
from specdecode.training import TrainConfig, data, trainer
from specdecode.training.evaluate import held_out_acceptance
from specdecode.training.features import collect
from specdecode.training.trainer import train

QUICK = TrainConfig(loss="ttt", epochs=12, lr=3e-3, batch=4)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny products run fastest on one thread (several only contend on a shared machine); the
    bitwise resume test compares runs made with the same thread count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def random_prompts(count: int, vocab: int, seed: int, length: int = 6) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (length,), generator=generator).tolist() for _ in range(count)]


def examples_for(target, engine, vocab_size: int, prompts: int = 32, new_tokens: int = 32):
    """The target's answers to random prompts, its draft vocabulary and features (last layer)."""
    samples = data.answers(engine, random_prompts(prompts, vocab_size, seed=0), 0, new_tokens, chat=False)
    vocabulary = data.draft_vocabulary(samples, vocab_size * 2 // 3, set())
    layers = (target.config.num_hidden_layers,)
    return vocabulary, layers, collect(target, samples, layers, 256)


def untrained_head(target, vocabulary, layers, seed=0, target_name=None):
    return new_head(target, head_config(target, layers, len(vocabulary), target_name), vocabulary, seed)


@pytest.fixture(scope="module")
def tiny():
    """A tiny Llama on transformers' runner, and a head trained on its answers (and an untrained one)."""
    target = tiny_llama(seed=3, vocab_size=24, max_positions=256, init=0.3)
    engine = SpeculativeEngine(target, drafter=None, runner="transformers")
    vocabulary, layers, examples = examples_for(target, engine, 24)
    head = untrained_head(target, vocabulary, layers)
    train(head, examples, QUICK)
    return target, engine, head, untrained_head(target, vocabulary, layers), examples


@pytest.mark.parametrize("layer_in_c", [True, False])
def test_the_drafting_copy_leaves_the_trained_head_alone_and_computes_its_logits(tiny, layer_in_c):
    """for_drafting (what HeadDrafter drafts with): the trained module keeps its nn.Linear weights
    (training and saving use it); the copy (its layer in one C call where the C layers run, w8a16
    products where the kernel runs, else float32 on oneDNN) gives the trained head's logits within
    8-bit error, the same bits each call."""
    _, _, head, _, _ = tiny
    before = {name: value.clone() for name, value in head.state_dict().items()}
    fast = for_drafting(head, layer_in_c)
    assert isinstance(head.layer.gate, torch.nn.Linear) and head.rows_product is None and head.kernel_layer is None
    assert all(torch.equal(before[name], value) for name, value in head.state_dict().items())
    assert fast.rows_product is not None and (fast.kernel_layer is not None or fast.layer.gate_up is not None)
    assert layer_in_c or fast.kernel_layer is None
    c = head.config
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(5, c.hidden_size, generator=generator)
    tokens = torch.randint(0, c.target_vocab_size, (5,), generator=generator)
    with torch.inference_mode():
        exact = head.logits(head(features, tokens, torch.arange(5), None, None)[0])
        drafted = [
            fast.logits(fast.draft_forward(features, tokens, torch.arange(5), HeadCache(c), None)) for _ in range(2)
        ]
    assert torch.equal(drafted[0], drafted[1])
    error = ((drafted[0] - exact).norm() / exact.norm()).item()
    limit = 1e-4 if drafting_kind(fast) == "float32" else 0.05  # w8a16 wherever some product is
    assert error < limit, (drafting_kind(fast), error)
    assert error > 0 or drafting_kind(fast) == "float32", "a w8a16 copy that computes the float32 logits is not w8a16"


def test_a_mask_becomes_the_tree_kernels_plan():
    """attention_plan (the head's C layer): the leading run of seen positions, then the others."""
    mask = torch.zeros(3, 7, dtype=torch.bool)
    mask[:, :4] = True  # four rows from the target's features
    mask[0, 4] = mask[1, [4, 5]] = mask[2, [4, 6]] = True  # a node, its child, and another child of it
    contiguous, extra = attention_plan(mask, 4, 3)
    assert contiguous.tolist() == [5, 6, 5] and extra.tolist() == [[-1], [-1], [6]]
    contiguous, extra = attention_plan(None, 4, 3)  # causal
    assert contiguous.tolist() == [5, 6, 7] and extra.shape == (3, 0)


def test_the_heads_c_layer_runs_a_tree_level_as_each_path_alone(tiny):
    """Where the head's layer runs in C, a level of tree nodes (each attending to the target-feature
    rows, its ancestors and itself) gives each node the bits of its path run as a chain after those
    rows; negative control: a node that also sees its sibling gets other bits."""
    fast = for_drafting(tiny[2])
    if fast.kernel_layer is None:
        pytest.skip("the C decoder layers do not run here")
    c = fast.config
    generator = torch.Generator().manual_seed(1)
    features = torch.randn(6, c.hidden_size, generator=generator)
    tokens = torch.randint(0, c.target_vocab_size, (6,), generator=generator)

    def run(rows: list[int], positions: list[int], mask: torch.Tensor | None, prefix: int = 3) -> torch.Tensor:
        cache = HeadCache(c)
        fast.draft_forward(features[:prefix], tokens[:prefix], torch.arange(prefix), cache, None)
        return fast.draft_forward(features[rows], tokens[rows], torch.tensor(positions), cache, mask)

    with torch.inference_mode():
        # rows 3 and 4 are children of the last feature row, row 5 a child of row 3
        tree = torch.zeros(3, 6, dtype=torch.bool)
        tree[:, :3] = True
        tree[0, 3] = tree[1, 4] = tree[2, [3, 5]] = True
        level = run([3, 4, 5], [3, 3, 4], tree)
        paths = [run([3], [3], None)[0], run([4], [3], None)[0], run([3, 5], [3, 4], None)[1]]
        assert all(torch.equal(level[i], path) for i, path in enumerate(paths))
        tree[1, 3] = True  # the second child sees the first: not its path
        assert not torch.equal(run([3, 4, 5], [3, 3, 4], tree)[1], paths[1])


def test_a_trained_head_is_accepted_more_often_than_an_untrained_one(tiny):
    target, engine, head, untrained, _ = tiny
    held_out = random_prompts(6, 24, seed=99)  # not among the training prompts (seed 0)
    before = held_out_acceptance(engine, untrained, held_out, k=3, max_new_tokens=32, chat=False)
    after = held_out_acceptance(engine, head, held_out, k=3, max_new_tokens=32, chat=False)
    assert after.acceptance_rate > 2 * before.acceptance_rate, (before, after)
    assert after.tokens_per_forward > before.tokens_per_forward + 0.1, (before, after)


def tiny_gemma3():
    config = T.Gemma3TextConfig(
        vocab_size=48, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, max_position_embeddings=128,
    )  # fmt: skip
    model = T.Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        model.model.norm.weight.normal_(0, 0.5)  # Gemma's norm scales by 1 + weight
    return model


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_the_heads_logits_through_the_targets_final_norm_are_the_targets(family):
    """head.logits on the target's last hidden state (before its final norm) gives the target's
    logits on the head's vocabulary: the soft labels it trains on, and the logits it drafts by."""
    target = tiny_llama(seed=4, vocab_size=48, max_positions=128) if family == "llama" else tiny_gemma3()
    kept = []
    target.model.norm.register_forward_hook(lambda module, args, output: kept.append(args[0]))
    with torch.no_grad():
        logits = target(torch.tensor([[1, 5, 9, 2, 7, 3]])).logits[0]
    vocabulary = torch.tensor([0, 3, 4, 10, 17, 30, 47])
    head = new_head(target, head_config(target, (2,), len(vocabulary)), vocabulary, 0)
    with torch.no_grad():
        ours = head.logits(kept[0][0].float())
    torch.testing.assert_close(ours, logits[:, vocabulary].float(), atol=1e-4, rtol=1e-4)


def test_greedy_with_the_head_equals_transformers_generate(tiny):
    target, engine, head, _, _ = tiny
    view = engine.with_drafter(HeadDrafter(head), num_speculative_tokens=3, adaptive=False)  # k pinned
    results = view.generate(GREEDY_PROMPTS, max_new_tokens=30)
    for prompt, result in zip(GREEDY_PROMPTS, results):
        assert result.token_ids == hf_greedy(target, prompt, 30), prompt
    assert_drafted_and_accepted(results)


def test_greedy_with_the_head_on_the_generic_fast_runner_equals_transformers_generate(tiny):
    """The generic runner's torch path keeps hidden states through its layers' hooks; the
    decoder runs each sequence on a slot, a copy of the runner, which must get them too."""
    target, _, head, _, _ = tiny
    engine = SpeculativeEngine(FastTransformersRunner(target), drafter=HeadDrafter(head), num_speculative_tokens=3)
    assert engine.target_runner._c_layers is None  # float32: the torch path
    results = engine.generate(GREEDY_PROMPTS, max_new_tokens=30)
    for prompt, result in zip(GREEDY_PROMPTS, results):
        assert result.token_ids == hf_greedy(target, prompt, 30), prompt
    assert_drafted_and_accepted(results)


def test_greedy_with_the_head_in_a_batch_equals_transformers_generate(tiny):
    """Each sequence of a batch has a head state of its own (fork) and gets its own rows' features."""
    target, engine, head, _, _ = tiny
    view = engine.with_drafter(HeadDrafter(head), num_speculative_tokens=3, adaptive=False)
    results = view.generate(GREEDY_PROMPTS, max_new_tokens=30, max_batch_size=3)
    for prompt, result in zip(GREEDY_PROMPTS, results):
        assert result.token_ids == hf_greedy(target, prompt, 30), prompt
    assert_drafted_and_accepted(results)


@pytest.fixture(scope="module")
def tree_target():
    """A target of head size 64 on the fast runner (where it verifies trees and keeps hidden
    states, else the test skips), and a head trained on its answers."""
    target = head64_llama(seed=2, dtype=torch.float32, vocab_size=64, initializer_range=0.1)
    runner = FastLlamaRunner(target)
    if not (runner.verifies_trees and hasattr(runner, "hidden_layers")):
        pytest.skip("this fast runner verifies no trees or keeps no hidden states")
    vocabulary, layers, examples = examples_for(target, SpeculativeEngine(target, runner="transformers"), 64)
    head = untrained_head(target, vocabulary, layers)
    train(head, examples, TrainConfig(epochs=4, lr=2e-3))
    return target, runner, head


TREE_PROMPTS = [[p % 64 for p in prompt] for prompt in GREEDY_PROMPTS]


@pytest.mark.parametrize("layer_in_c", [True, False])
def test_greedy_head_trees_on_the_fast_runner_equal_transformers_generate(tree_target, layer_in_c):
    """The head's layer in C (where the C layers run) or on torch's operations."""
    target, runner, head = tree_target
    engine = SpeculativeEngine(runner, drafter=None)
    prompts = TREE_PROMPTS
    drafter = HeadDrafter(head, tree=True, fast=for_drafting(head, layer_in_c))
    view = engine.with_drafter(drafter, num_speculative_tokens=6, adaptive=False)
    results = view.generate(prompts, max_new_tokens=30)
    for prompt, result in zip(prompts, results):
        assert result.token_ids == hf_greedy(target, prompt, 30), prompt
    assert_drafted_and_accepted(results)
    assert sum(r.stats.tree_steps for r in results) > 0  # trees were verified, not only chains


def test_the_heads_tree_is_one_hot_and_its_first_path_is_its_greedy_chain(tiny):
    target, engine, head, _, _ = tiny
    greedy = SamplingParams()
    runner = HFModelRunner(target)
    runner.hidden_layers = head.config.feature_layers
    tokens = [3, 5, 7, 2, 9, 11]
    runner.forward(torch.tensor(tokens[:-1]), 1)
    drafters = [HeadDrafter(head, tree=True), HeadDrafter(head)]
    for drafter in drafters:
        drafter.begin(tokens)
        drafter.learn_hidden(0, runner.hidden)
    tree = drafters[0].propose(tokens, 8, greedy, None)
    chain = drafters[1].propose(tokens, 8, greedy, None)
    assert tree.probs is None and not tree.is_chain and len(tree) == 8
    first = tree.first_path()
    assert first.tokens.tolist() == chain.tokens[: len(first)].tolist()


# --- sampling: the G-test of tests/helpers/, with a negative control ---


def sampling_head(seed: int = 0):
    """The G-test's target (vocabulary DIST_VOCAB) and a head over 8 of its 12 tokens, trained briefly."""
    target, other = target_and_draft(tiny_llama)
    engine = SpeculativeEngine(target, drafter=None, runner="transformers")
    samples = data.answers(engine, [PROMPT] * 8 + random_prompts(8, DIST_VOCAB, 1), 0, 16, chat=False)
    vocabulary = data.draft_vocabulary(samples, 8, set())
    layers = (target.config.num_hidden_layers,)
    head = untrained_head(target, vocabulary, layers, seed)
    train(head, collect(target, samples, layers, 256), TrainConfig(epochs=4, lr=3e-3))
    return target, other, head


class OffVocabularyBug(HeadDrafter):
    """Wrong: reports a q that gives tokens off the head's vocabulary some mass, while drawing
    from the head's vocabulary only (what a full-vocabulary softmax would report)."""

    def propose(self, token_ids, k, params, generator):
        draft = super().propose(token_ids, k, params, generator)
        if draft.probs is None:
            return draft
        return Draft(draft.tokens, 0.5 * draft.probs + 0.5 / draft.probs.shape[-1])

    def fork(self):
        return OffVocabularyBug(self.head, self.drafts_trees, self.branching)


def test_sampling_with_the_heads_q_keeps_the_targets_law():
    params = dict(temperature=1.0)
    target, other, head = sampling_head()
    assert len(head.vocabulary) < DIST_VOCAB  # q is zero somewhere: the case FR-Spec must get right
    engine = SpeculativeEngine(target, drafter=HeadDrafter(head), num_speculative_tokens=3, runner="transformers")
    counts = sample_counts(engine, 3, params, seed=21)
    assert g_test_pvalue(counts, exact_joint(target, params)) > ALPHA
    assert g_test_pvalue(counts, exact_joint(other, params)) < ALPHA
    # the law was kept with the head's drafts in play: they were drawn and some accepted
    assert_drafted_and_accepted(engine.generate([PROMPT] * 20, max_new_tokens=6, seed=3, **params))


def test_negative_control_a_q_that_is_not_zero_off_the_vocabulary_is_caught():
    params = dict(temperature=1.0)
    target, _, head = sampling_head()
    engine = SpeculativeEngine(target, drafter=OffVocabularyBug(head), num_speculative_tokens=3, runner="transformers")
    counts = sample_counts(engine, 3, params, seed=21)
    assert g_test_pvalue(counts, exact_joint(target, params)) < ALPHA


def test_sampled_head_trees_on_the_fast_runner_keep_the_targets_law():
    """The head's trees are one-hot at every temperature (a function of the context), so sampled
    they go through the tree rule: the G-test against the target's exact law on the fast runner's
    tree forward, k pinned, and the law of a nearby model rejected (negative control)."""
    params = dict(temperature=1.0)
    target = head64_llama(seed=1, dtype=torch.float32, vocab_size=DIST_VOCAB, initializer_range=0.05)
    runner = FastLlamaRunner(target)
    if not (runner.verifies_trees and hasattr(runner, "hidden_layers")):
        pytest.skip("this fast runner verifies no trees or keeps no hidden states")
    engine = SpeculativeEngine(target, drafter=None, runner="transformers")
    samples = data.answers(engine, [PROMPT] * 8 + random_prompts(8, DIST_VOCAB, 1), 0, 16, chat=False)
    layers = (target.config.num_hidden_layers,)
    head = untrained_head(target, data.draft_vocabulary(samples, 8, set()), layers)
    train(head, collect(target, samples, layers, 256), TrainConfig(epochs=4, lr=3e-3))
    drafter = HeadDrafter(head, tree=True)
    engine = SpeculativeEngine(runner, drafter=drafter, num_speculative_tokens=4)
    counts = sample_counts(engine, 4, params, seed=21)
    assert g_test_pvalue(counts, exact_joint(target, params)) > ALPHA
    assert g_test_pvalue(counts, exact_joint(nearby_draft(target, noise=0.5), params)) < ALPHA
    # what was tested: the head's trees, drawn and some accepted
    results = engine.generate([PROMPT] * 20, max_new_tokens=6, seed=3, **params)
    assert_drafted_and_accepted(results)
    assert sum(r.stats.tree_steps for r in results) > 0


# --- save, load, resume ---


def test_a_saved_head_loads_with_the_same_weights_and_drafts(tiny, tmp_path):
    target, engine, head, _, _ = tiny
    save_head(head, tmp_path)
    assert {p.name for p in tmp_path.iterdir()} == {"config.json", "head.safetensors", "vocabulary.json"}
    assert is_head_folder(tmp_path) and not is_head_folder(tmp_path / "absent")
    loaded = load_head(tmp_path, target)
    assert loaded.config == head.config
    assert torch.equal(loaded.vocabulary, head.vocabulary)
    for name, value in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    views = [engine.with_drafter(HeadDrafter(h), 3) for h in (head, loaded)]
    first, second = (v.generate(GREEDY_PROMPTS, max_new_tokens=20)[0].stats for v in views)
    assert (first.drafted_tokens, first.accepted_tokens) == (second.drafted_tokens, second.accepted_tokens)


@pytest.mark.parametrize("input_norms", [True, False])
def test_a_head_with_input_norms_reads_its_features_whatever_their_scale(input_norms):
    """A target whose features run far larger than its embeddings (Gemma 3's last layer) leaves a
    head with input norms unmoved: its logits for features scaled by 2^10 are its logits for the
    features themselves. Negative control: a head without them (the shipped SmolLM2 head's kind)
    computes other logits."""
    target = tiny_llama(seed=4, vocab_size=48, max_positions=128)
    vocabulary = torch.arange(0, 48, 3)
    head = new_head(target, head_config(target, (2,), len(vocabulary), input_norms=input_norms), vocabulary, 0)
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(4, head.config.hidden_size, generator=generator)
    tokens, rows = torch.tensor([1, 5, 9, 2]), torch.arange(4)
    with torch.no_grad():
        plain, scaled = (head.logits(head(f, tokens, rows, None, None)[0]) for f in (features, features * 1024))
    if input_norms:
        torch.testing.assert_close(scaled, plain, atol=1e-4, rtol=1e-4)
    else:
        assert not torch.allclose(scaled, plain, atol=1e-2, rtol=1e-2)


def test_a_head_saved_before_input_norms_loads_without_them(tiny, tmp_path):
    """A head folder whose config predates `input_norms` (the shipped SmolLM2 head's) loads as a
    head without them, with its own weights."""
    target, engine, _, _, _ = tiny
    vocabulary, layers = torch.arange(0, 24, 2), (target.config.num_hidden_layers,)
    head = new_head(target, head_config(target, layers, len(vocabulary), input_norms=False), vocabulary, 1)
    save_head(head, tmp_path)
    config = json.loads((tmp_path / HEAD_CONFIG).read_text())
    del config["input_norms"]
    (tmp_path / HEAD_CONFIG).write_text(json.dumps(config))
    loaded = load_head(tmp_path, target)
    assert loaded.config == head.config and not loaded.config.input_norms
    assert all(torch.equal(loaded.state_dict()[name], value) for name, value in head.state_dict().items())
    assert loaded.state_dict().keys() == head.state_dict().keys()
    assert not {"embed_norm", "feature_norm"} & loaded.state_dict().keys()


def test_a_head_for_another_target_shape_is_refused(tiny, tmp_path):
    _, _, head, _, _ = tiny
    save_head(head, tmp_path)
    with pytest.raises(InvalidArgumentError, match="vocabulary"):
        load_head(tmp_path, tiny_llama(seed=0, vocab_size=30))
    (tmp_path / HEAD_CONFIG).unlink()
    with pytest.raises(InvalidArgumentError, match="no draft head"):
        load_head(tmp_path, tiny_llama(seed=0))


class Interrupted(Exception):
    pass


def weights_after(target, vocabulary, layers, examples, config, checkpoint, interrupt_at=None, seed=0):
    head = untrained_head(target, vocabulary, layers, seed)

    def on_step(step, total, loss):
        if step == interrupt_at:
            raise Interrupted

    try:
        state = train(head, examples, config, checkpoint, on_step)
    except Interrupted:
        return None, None
    return head.state_dict(), state


@pytest.mark.parametrize("loss", ["ttt", "eagle"])
def test_a_resumed_training_ends_with_bitwise_the_uninterrupted_weights(tiny, tmp_path, loss):
    target, _, head, _, examples = tiny
    vocabulary, layers = head.vocabulary, head.config.feature_layers
    config = TrainConfig(loss=loss, epochs=2, lr=3e-3, batch=4, checkpoint_every=3)  # 16 steps
    whole, _ = weights_after(target, vocabulary, layers, examples, config, tmp_path / "whole.pt")
    # interrupted after step 5: the last checkpoint is step 3's; steps 4 and 5 are done again
    assert weights_after(target, vocabulary, layers, examples, config, tmp_path / "cut.pt", interrupt_at=5)[0] is None
    assert torch.load(tmp_path / "cut.pt", weights_only=True)["state"]["step"] == 3
    resumed, state = weights_after(target, vocabulary, layers, examples, config, tmp_path / "cut.pt")
    assert state.resumed_from == 3 and state.step == 16
    for name, value in whole.items():
        assert torch.equal(resumed[name], value), name
    # the comparison can fail: another seed's initial weights end elsewhere
    other, _ = weights_after(target, vocabulary, layers, examples, config, tmp_path / "other.pt", seed=1)
    assert not all(torch.equal(other[name], value) for name, value in whole.items())


def test_a_checkpoint_of_other_options_is_refused(tiny, tmp_path):
    target, _, head, _, examples = tiny
    vocabulary, layers = head.vocabulary, head.config.feature_layers
    config = TrainConfig(epochs=1, batch=8, checkpoint_every=1)
    weights_after(target, vocabulary, layers, examples, config, tmp_path / "c.pt")
    with pytest.raises(InvalidArgumentError, match="another training setup"):
        weights_after(target, vocabulary, layers, examples, TrainConfig(epochs=2, batch=8), tmp_path / "c.pt")


def test_a_checkpoint_of_another_vocabulary_or_features_is_refused_in_one_line(tiny, tmp_path):
    target, _, head, _, examples = tiny
    vocabulary, layers = head.vocabulary, head.config.feature_layers
    config = TrainConfig(epochs=1, batch=8, checkpoint_every=1)
    weights_after(target, vocabulary, layers, examples, config, tmp_path / "c.pt")
    assert (
        weights_after(target, vocabulary, layers, examples, config, tmp_path / "c.pt")[0] is not None
    )  # same: resumes
    other_vocabulary = vocabulary.flip(0)  # the same size, other tokens: shapes alone would not tell
    with pytest.raises(InvalidArgumentError, match="another shape or vocabulary"):
        weights_after(target, other_vocabulary, layers, examples, config, tmp_path / "c.pt")


DAMAGE = {
    "cut short": lambda whole: whole[: len(whole) // 2],
    "empty": lambda whole: b"",
    "garbage": lambda whole: b"\x80\x02not a checkpoint" * 8,
    "another file": lambda whole: _saved({"weights": torch.zeros(2)}),
}


def _saved(contents) -> bytes:
    buffer = io.BytesIO()
    torch.save(contents, buffer)
    return buffer.getvalue()


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_checkpoint_is_refused_in_one_line_naming_restart_training(tiny, tmp_path, damage):
    target, _, head, _, examples = tiny
    vocabulary, layers = head.vocabulary, head.config.feature_layers
    config = TrainConfig(epochs=1, batch=8, checkpoint_every=1)
    checkpoint = tmp_path / "checkpoint.pt"
    weights_after(target, vocabulary, layers, examples, config, checkpoint)
    checkpoint.write_bytes(DAMAGE[damage](checkpoint.read_bytes()))
    with pytest.raises(InvalidArgumentError, match="rerun with --restart-training") as refused:
        weights_after(target, vocabulary, layers, examples, config, checkpoint)
    assert str(checkpoint) in str(refused.value) and "\n" not in str(refused.value)


def test_a_checkpoint_is_on_disk_before_it_replaces_the_last_one(tiny, tmp_path, monkeypatch):
    """A kill or a lost machine after the rename finds the whole new file, never one cut short."""
    target, _, head, _, examples = tiny
    events, replace = [], os.replace
    monkeypatch.setattr(trainer.os, "fsync", lambda fd: events.append("fsync"))
    monkeypatch.setattr(trainer.os, "replace", lambda *paths: events.append("replace") or replace(*paths))
    config = TrainConfig(epochs=1, batch=8, checkpoint_every=2)  # 4 steps: checkpoints after 2 and 4
    weights_after(target, head.vocabulary, head.config.feature_layers, examples, config, tmp_path / "c.pt")
    assert events == ["fsync", "replace"] * 2


# --- data ---


def test_the_draft_vocabulary_is_the_most_frequent_answer_tokens_and_eos():
    samples = [data.Sample([1], [5, 5, 5, 7, 7, 9], False), data.Sample([1], [7, 3], True)]
    assert data.draft_vocabulary(samples, 3, {0}).tolist() == [0, 5, 7]  # eos 0 never occurs, still in
    assert data.draft_vocabulary(samples, 10, set()).tolist() == [3, 5, 7, 9]


def test_prompts_leave_held_out_ones_out_and_refuse_spec_bench(tmp_path):
    path = tmp_path / "prompts.jsonl"
    lines = [{"prompt": "Tell me a story."}, {"prompt": "tell me  a story."}, {"prompt": "Held out one"}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert data.read_prompts(path, held_out=["held OUT one"]) == ["Tell me a story."]
    path.write_text(json.dumps({"question_id": 1, "category": "writing", "turns": ["Write."]}) + "\n")
    with pytest.raises(InvalidArgumentError, match="Spec-Bench"):
        data.read_prompts(path, held_out=[])


def test_from_pretrained_drafts_with_a_head_folder_by_name_and_in_auto(tiny, tmp_path):
    """`--drafter head --draft DIR` (and `auto` with a head folder as --draft) load the head
    for the target and draft with it; greedy output stays transformers' own."""
    target, _, head, _, _ = tiny
    target.save_pretrained(tmp_path / "target")
    tiny_tokenizer(24).save_pretrained(tmp_path / "target")
    save_head(head, tmp_path / "head")
    common = dict(draft=str(tmp_path / "head"), runner="transformers", num_speculative_tokens=3)
    engine = SpeculativeEngine.from_pretrained(
        str(tmp_path / "target"), drafter="head", options=DrafterOptions(adaptive=False), **common
    )
    assert isinstance(engine.drafter, HeadDrafter)
    results = engine.generate(GREEDY_PROMPTS, max_new_tokens=30)
    for prompt, result in zip(GREEDY_PROMPTS, results):
        expected = hf_greedy(target, prompt, 30)
        # the saved tokenizer names token 0 <eos>, where the engine stops (transformers' run has none)
        assert result.token_ids == (expected[: expected.index(0) + 1] if 0 in expected else expected), prompt
    assert_drafted_and_accepted(results)
    auto = SpeculativeEngine.from_pretrained(str(tmp_path / "target"), drafter="auto", **common)
    assert any(isinstance(c, HeadDrafter) for c in auto.drafter.candidates)
    with pytest.raises(InvalidArgumentError, match="is no draft head folder"):
        SpeculativeEngine.from_pretrained(str(tmp_path / "target"), drafter="head", draft=str(tmp_path))


# --- which target: the fingerprint, the shipped head, auto ---


def test_the_target_fingerprint_is_the_same_in_float32_bfloat16_and_a_saved_folder(tmp_path):
    target = tiny_llama(seed=3, vocab_size=24)
    fingerprint = target_fingerprint(target)
    assert target_fingerprint(copy.deepcopy(target).to(torch.bfloat16)) == fingerprint
    target.save_pretrained(tmp_path)
    reloaded = type(target).from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert target_fingerprint(reloaded) == fingerprint
    # the comparison can fail: another model of the same shapes, or one embedding row moved
    assert target_fingerprint(tiny_llama(seed=4, vocab_size=24)) != fingerprint
    moved = copy.deepcopy(target)
    with torch.no_grad():
        moved.get_input_embeddings().weight[0] += 0.5
    assert target_fingerprint(moved) != fingerprint


def heads_folder(tmp_path, tiny):
    """heads/mine: the trained head of `tiny`'s target; heads/other: a head for another target
    of the same shapes (named other-target)."""
    target, _, head, _, _ = tiny
    other = tiny_llama(seed=4, vocab_size=24, max_positions=256, init=0.3)
    save_head(head, tmp_path / "heads" / "mine")
    foreign = untrained_head(other, head.vocabulary, head.config.feature_layers, target_name="other-target")
    save_head(foreign, tmp_path / "heads" / "other")
    return tmp_path / "heads", other


def test_shipped_head_finds_the_head_for_its_target_and_never_another_targets(tiny, tmp_path):
    target, _, head, _, _ = tiny
    heads, other = heads_folder(tmp_path, tiny)
    assert head.config.target_fingerprint == target_fingerprint(target)
    assert shipped_head(target, heads) == heads / "mine"
    assert shipped_head(other, heads) == heads / "other"
    assert shipped_head(tiny_llama(seed=5, vocab_size=24), heads) is None  # no head for this one
    assert shipped_head(target, tmp_path / "absent") is None
    assert shipped_head(tiny_gpt2(seed=0), heads) is None  # no Llama-family target: no head drafts for it
    (heads / "mine" / HEAD_CONFIG).unlink()
    assert shipped_head(target, heads) is None  # the other target's head is not taken instead
    # by name (--drafter head --draft DIR), another target's head is an error naming draft
    with pytest.raises(InvalidArgumentError, match="trained for 'other-target'") as caught:
        load_head(heads / "other", target)
    assert caught.value.param == "draft"


def saved_target(target, tokenizer_vocab: int, folder):
    target.save_pretrained(folder)
    tiny_tokenizer(tokenizer_vocab).save_pretrained(folder)
    return str(folder)


def until_eos(tokens: list[int]) -> list[int]:
    """The saved tokenizer names token 0 <eos>, where the engine stops (transformers' run has none)."""
    return tokens[: tokens.index(0) + 1] if 0 in tokens else tokens


def assert_the_head_drafted_and_was_kept(results):
    drafted, accepted = (sum(r.stats.drafted_by_source.get("head", [0, 0])[i] for r in results) for i in (0, 1))
    assert drafted > 0 and accepted > 0, [r.stats.drafted_by_source for r in results]


def test_auto_drafts_with_the_shipped_head_for_its_target(tiny, tmp_path, monkeypatch):
    """A chain target (transformers' runner): prompt lookup, the draft store, then the head."""
    target, _, _, _, _ = tiny
    heads, _ = heads_folder(tmp_path, tiny)
    monkeypatch.setattr("specdecode.drafters.head.SHIPPED_HEADS", heads)
    folder = saved_target(target, 24, tmp_path / "target")
    common = dict(runner="transformers", dtype="float32", num_speculative_tokens=3)
    engine = SpeculativeEngine.from_pretrained(folder, options=DrafterOptions(adaptive=False), **common)  # k pinned
    assert [c.name for c in engine.drafter.candidates] == ["prompt-lookup", "suffix", "head"]
    results = engine.generate(GREEDY_PROMPTS, max_new_tokens=30)
    for prompt, result in zip(GREEDY_PROMPTS, results):
        assert result.token_ids == until_eos(hf_greedy(target, prompt, 30)), prompt
    assert_the_head_drafted_and_was_kept(results)
    # switched off, auto is what it is without a head
    off = SpeculativeEngine.from_pretrained(folder, options=DrafterOptions(shipped_head=False), **common)
    assert [c.name for c in off.drafter.candidates] == ["prompt-lookup", "suffix"]
    with pytest.raises(InvalidArgumentError, match="applies to drafter 'auto' only") as caught:
        SpeculativeEngine.from_pretrained(folder, drafter="recycling", options=DrafterOptions(shipped_head=False))
    assert caught.value.param == "shipped_head"
    # another target's head, given by name, is refused before anything drafts
    with pytest.raises(InvalidArgumentError, match="other-target") as caught:
        SpeculativeEngine.from_pretrained(folder, drafter="head", draft=str(heads / "other"), **common)
    assert caught.value.param == "draft"


def test_auto_on_a_tree_target_tries_the_shipped_head_before_recycling(tree_target, tmp_path, monkeypatch):
    """Recycling always proposes a tree, so the head comes before it, after prompt lookup and
    the draft store; without a head, auto keeps recycling first."""
    target, _, head = tree_target
    save_head(head, tmp_path / "heads" / "mine")
    monkeypatch.setattr("specdecode.drafters.head.SHIPPED_HEADS", tmp_path / "heads")
    folder = saved_target(target, 64, tmp_path / "target")
    common = dict(dtype="float32", num_speculative_tokens=6)
    engine = SpeculativeEngine.from_pretrained(folder, options=DrafterOptions(adaptive=False), **common)  # k pinned
    assert [c.name for c in engine.drafter.candidates] == ["prompt-lookup", "suffix", "head", "recycling"]
    assert engine.drafter.candidates[2].drafts_trees
    results = engine.generate(TREE_PROMPTS, max_new_tokens=30)
    for prompt, result in zip(TREE_PROMPTS, results):
        assert result.token_ids == until_eos(hf_greedy(target, prompt, 30)), prompt
    assert_the_head_drafted_and_was_kept(results)
    assert sum(r.stats.tree_steps for r in results) > 0
    # k pinned: the head, which has features after the prefill, proposes every step, so recycling never does
    assert all("recycling" not in r.stats.drafted_by_source for r in results)
    off = SpeculativeEngine.from_pretrained(folder, options=DrafterOptions(shipped_head=False), **common)
    assert [c.name for c in off.drafter.candidates] == ["recycling", "prompt-lookup", "suffix"]


@pytest.mark.skipif(not int8_supported(), reason="no oneDNN int8 products in this torch")
def test_over_a_w8a8_target_the_head_reads_the_embedding_the_target_reads_and_both_free_the_matrix(tmp_path):
    """A tied embedding that w8a8 reads from its head's int8 codes: the head drafts through the
    same lookups (its buffer of the 16-bit matrix dropped), the model's matrix is freed, and
    greedy output is the 8-bit target's own target-only decoding."""
    target = head64_llama(seed=2, dtype=torch.bfloat16, vocab_size=64, initializer_range=0.1, tie_word_embeddings=True)
    vocabulary, layers, examples = examples_for(target, SpeculativeEngine(target, runner="transformers"), 64)
    head = untrained_head(target, vocabulary, layers)
    train(head, examples, TrainConfig(epochs=4, lr=2e-3))
    save_head(head, tmp_path / "head")
    engine = SpeculativeEngine.from_pretrained(
        saved_target(target, 64, tmp_path / "target"),
        quantization="w8a8",
        dtype="bfloat16",
        drafter="head",
        draft=str(tmp_path / "head"),
        num_speculative_tokens=4,
        options=DrafterOptions(adaptive=False),
    )
    runner = engine.target_runner
    if runner.embedding_kind != "int8 codes of the output head":
        pytest.skip("this CPU's w8a8 head is oneDNN's prepacked weight: the embedding matrix stays")
    assert runner.model.get_input_embeddings().weight.device.type == "meta"
    assert "embed" not in dict(engine.drafter.fast.named_buffers())
    assert engine.drafter.fast.token_embedding is runner.embedding
    prompts = TREE_PROMPTS
    results = engine.generate(prompts, max_new_tokens=30)
    assert_drafted_and_accepted(results)
    target_only = engine.generate(prompts, max_new_tokens=30, speculative=False)
    assert [r.token_ids for r in results] == [r.token_ids for r in target_only]


def test_the_cache_identity_of_a_head_is_its_weights_vocabulary_and_drafting(tiny, tmp_path):
    _, _, head, untrained, _ = tiny
    identity = drafter_identity(HeadDrafter(head))
    assert identity is not None and identity == drafter_identity(HeadDrafter(head).fork())
    assert identity != drafter_identity(HeadDrafter(untrained))
    assert identity != drafter_identity(HeadDrafter(head, tree=True))
    save_head(head, tmp_path)
    assert drafter_identity(HeadDrafter(load_head(tmp_path, tiny[0]))) == identity  # float32: bitwise the same
    changed = copy.deepcopy(head)
    assert drafter_identity(HeadDrafter(changed)) == identity
    with torch.no_grad():
        changed.fc.weight[0, 0] += 1e-3  # as an optimizer step does: in place
    assert drafter_identity(HeadDrafter(changed)) != identity


def test_a_head_stored_in_bfloat16_loads_as_float32_and_drafts_exactly(tiny, tmp_path):
    target, engine, head, _, _ = tiny
    save_head(head, tmp_path / "float32")
    save_head(head, tmp_path / "bfloat16", dtype=torch.bfloat16)
    sizes = [(tmp_path / name / HEAD_WEIGHTS).stat().st_size for name in ("float32", "bfloat16")]
    assert sizes[1] < 0.6 * sizes[0]
    loaded = load_head(tmp_path / "bfloat16", target)
    for name, value in head.state_dict().items():
        assert loaded.state_dict()[name].dtype == torch.float32, name
        assert torch.equal(loaded.state_dict()[name], value.to(torch.bfloat16).float()), name
    view = engine.with_drafter(HeadDrafter(loaded), num_speculative_tokens=3, adaptive=False)
    results = view.generate(GREEDY_PROMPTS, max_new_tokens=30)
    for prompt, result in zip(GREEDY_PROMPTS, results):
        assert result.token_ids == hf_greedy(target, prompt, 30), prompt
    assert_drafted_and_accepted(results)
