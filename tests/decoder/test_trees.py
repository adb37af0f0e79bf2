"""Draft trees: the tree accept rule (core/verification.py), the decoder's tree steps
(decoder.py), tree stats (core/stats.py) and the tree-size policy (core/adaptive.py).

Most tests run on a made-up target (`Table`): its logits after a context are a seeded
function of the whole context, so the target's exact law and its greedy text are known
without a model, and its runner (`TableRunner`) keeps the tokens at each position as its
"cache": a tree's rejected nodes left in place would change what later tokens see, as stale
KV entries would, unless the decoder keeps the accepted path. Sampling is checked by G-test
(tests/helpers/) with negative controls that must fail; greedy decoding against the
target's own greedy text, and on a tiny float32 Llama against transformers' `generate`.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import helpers
from helpers import (
    ALPHA,
    DIST_VOCAB,
    GREEDY_PROMPTS,
    VOCAB,
    exact_joint,
    g_test_pvalue,
    head64_llama,
    hf_greedy,
    nearby_draft,
    reference_probs,
    sample_counts,
    tiny_llama,
)
from specdecode import SpeculativeEngine
from specdecode.core.adaptive import AdaptiveK, AdaptiveTree
from specdecode.core.sampling import SamplingParams, logits_to_probs, sample
from specdecode.core.stats import GenerationStats
from specdecode.core.verification import Verdict, verify_greedy, verify_tree
from specdecode.drafters import Draft, Drafter
from specdecode.runners import HFModelRunner
from specdecode.runners.fast_llama import FastLlamaRunner

PROMPT = (3, 5, 7, 2)
SAMPLES = 3000  # of the tree rule alone; decoding through the engine takes helpers.SAMPLES
WINDOW = 2  # tokens whose joint law is tested


# --- a made-up target, its exact law, and its runner ---


class Table:
    """Logits [vocab] after any context (a tuple of token ids): seeded by the context, memoised;
    with a base, the base's logits and that noise (a draft that agrees often, not always)."""

    def __init__(self, seed: int, vocab: int = DIST_VOCAB, scale: float = 1.5, base: Table | None = None):
        self.seed, self.vocab, self.scale, self.base = seed, vocab, scale, base
        self._logits: dict[tuple, torch.Tensor] = {}

    def logits(self, context: tuple) -> torch.Tensor:  # [vocab] float32
        if context not in self._logits:
            generator = torch.Generator().manual_seed(hash((self.seed,) + context) % 2**62)
            noise = torch.randn(self.vocab, generator=generator) * self.scale
            self._logits[context] = noise if self.base is None else self.base.logits(context) + noise
        return self._logits[context]

    def greedy(self, context: tuple, n: int) -> list[int]:
        out: list[int] = []
        for _ in range(n):
            out.append(int(self.logits(context + tuple(out)).argmax()))
        return out


def exact_windows(table: Table, prompt: tuple, params: dict, length: int) -> dict[int, np.ndarray]:
    """The exact law of the first `length` new tokens, as windows: start -> P(tokens start,
    start + 1) flattened [vocab ** WINDOW], computed in float64 by helpers.reference_probs."""
    vocab = table.vocab
    joint = np.ones([vocab] * 0)
    for n in range(length):
        conditional = np.empty([vocab] * (n + 1))
        for prefix in np.ndindex(*([vocab] * n)):
            conditional[prefix] = reference_probs(table.logits(prompt + prefix).numpy(), **params)
        joint = joint[..., None] * conditional
    return {
        start: joint.sum(axis=tuple(range(start)) + tuple(range(start + WINDOW, length))).reshape(-1)
        for start in range(0, length - WINDOW + 1, WINDOW)
    }


def window_counts(samples: list[list[int]], start: int, vocab: int = DIST_VOCAB) -> np.ndarray:
    counts = np.zeros(vocab**WINDOW)
    for tokens in samples:
        counts[np.ravel_multi_index(tokens[start : start + WINDOW], [vocab] * WINDOW)] += 1
    return counts


class TableRunner(HFModelRunner):
    """Table as a ModelRunner: the cache is the token at each position. A tree's node sees the
    cached tokens, its ancestors and itself; `keep` moves the accepted path's tokens together."""

    verifies_trees = True
    stacks_sequences = False
    batch_invariant = True
    compilable = False
    rolls_back = True

    def __init__(self, table: Table, max_length: int = 128):  # no model: HFModelRunner's init is not run
        self.table, self.vocab_size, self.max_length = table, table.vocab, max_length
        self.dtype, self.device = torch.float32, torch.device("cpu")
        self.reset()

    @property
    def cache_length(self) -> int:
        return len(self.held)

    def reset(self) -> None:
        self.held: list[int] = []

    def forward(self, token_ids: torch.Tensor, num_logits: int, parents: torch.Tensor | None = None) -> torch.Tensor:
        new = token_ids.tolist()
        parent_list = list(range(-1, len(new) - 1)) if parents is None else parents.tolist()
        contexts: list[tuple] = []
        for token, parent in zip(new, parent_list, strict=True):
            contexts.append((contexts[parent] if parent >= 0 else tuple(self.held)) + (token,))
        self.held += new
        return torch.stack([self.table.logits(c) for c in contexts[len(new) - num_logits :]])

    def crop(self, length: int) -> None:
        del self.held[length:]

    def keep(self, start: int, offsets: list[int]) -> None:
        self.held[start:] = [self.held[start + o] for o in offsets]


class ChainTableRunner(TableRunner):
    verifies_trees = False

    def forward(self, token_ids, num_logits, parents=None):
        assert parents is None, "a runner that cannot verify trees was given one"
        return super().forward(token_ids, num_logits)


# --- trees ---


def top_tree(draft: Table, context: tuple, depth: int, branching: int, most: int = 10**6, duplicate: bool = False):
    """Breadth first: each node's children are the `branching` tokens draft likes best after
    it (duplicate: and the first of them again, last), to `depth`, at most `most` nodes.
    Returns tokens, parents and each node's path (its tokens from the root's first child)."""
    tokens, parents, paths = [], [], []
    frontier = [(-1, ())]
    for _ in range(depth):
        next_frontier = []
        for parent, path in frontier:
            children = draft.logits(context + path).argsort(descending=True)[:branching].tolist()
            for token in children + children[:1] * duplicate:
                if len(tokens) == most:
                    return tokens, parents, paths
                tokens.append(token)
                parents.append(parent)
                paths.append(path + (token,))
                next_frontier.append((len(tokens) - 1, paths[-1]))
        frontier = next_frontier
    return tokens, parents, paths


def random_tree(rng: random.Random, size: int, vocab: int, truth: list[int]) -> tuple[list[int], list[int]]:
    """size nodes under random parents with random tokens, among them (with probability 0.6)
    some of truth's first tokens as a path from the root, anywhere among its siblings."""
    wanted = rng.randint(1, len(truth)) if truth and rng.random() < 0.6 else 0
    tokens, parents, true_nodes = [], [], []
    for i in range(size):
        if len(true_nodes) < wanted and rng.random() < 0.5:
            parents.append(true_nodes[-1] if true_nodes else -1)
            tokens.append(truth[len(true_nodes)])
            true_nodes.append(i)
        else:
            parents.append(rng.randrange(-1, i))
            tokens.append(rng.randrange(vocab))
    return tokens, parents


class TreeDrafter(Drafter):
    """A test drafter of trees: `trees(token_ids, k)` gives (tokens, parents); it records what
    the decoder tells it (observe, learn)."""

    name = "trees"
    per_sequence = True
    depends_on_history = False
    drafts_trees = True

    def __init__(self, trees, records: dict | None = None):
        self.trees = trees
        self.records = records if records is not None else {"observed": [], "learnt": [], "proposed": []}

    def begin(self, prompt_ids):
        pass

    def propose(self, token_ids, k, params, generator):
        tokens, parents = self.trees(tuple(token_ids), k)
        draft = Draft(torch.tensor(tokens, dtype=torch.long), None, parents=torch.tensor(parents, dtype=torch.long))
        self.records["proposed"].append(draft)
        return draft

    def observe(self, num_drafted, num_accepted):
        self.records["observed"].append((num_drafted, num_accepted))

    def learn(self, token_ids, draft, logits):
        self.records["learnt"].append((list(token_ids), draft, logits.clone()))

    def finish(self, token_ids):
        pass

    def fork(self):
        return TreeDrafter(self.trees, self.records)


def oracle_trees(truth, vocab: int, seed: int = 0):
    """Random trees (a function of the context) that hold truth(context)'s first tokens sometimes."""

    def trees(context: tuple, k: int):
        rng = random.Random(hash((seed,) + context))
        return random_tree(rng, k, vocab, truth(context))

    return trees


# --- the tree rule on hand-made logits ---


def one_hot_rows(*argmaxes: int, vocab: int = 6) -> torch.Tensor:
    return torch.eye(vocab)[list(argmaxes)] * 3.0


def test_greedy_tree_rule_follows_the_child_that_is_the_argmax():
    # root -> 0:(1) 1:(2); 1 -> 2:(4) 3:(3); 3 -> 4:(5)
    tokens, parents = torch.tensor([1, 2, 4, 3, 5]), [-1, -1, 1, 1, 3]
    # argmax after the root: 2 (node 1); after node 1: 3 (node 3); after node 3: 5 (node 4); after node 4: 0
    logits = one_hot_rows(2, 0, 3, 0, 5, 0)
    verdict = verify_tree(tokens, parents, logits, SamplingParams(0.0), None)
    assert verdict == Verdict(3, 0, (1, 3, 4))
    # no child is the argmax: nothing accepted, the argmax emitted
    assert verify_tree(tokens, parents, one_hot_rows(4, 0, 0, 0, 0, 0), SamplingParams(0.0), None) == Verdict(0, 4, ())


def test_of_two_children_with_one_token_the_first_is_followed():
    tokens, parents = torch.tensor([2, 2, 1]), [-1, -1, 1]  # node 2 hangs under the second 2
    logits = one_hot_rows(2, 4, 1, 0)  # after the first 2: 4; after the second 2: 1 (node 2 would match)
    assert verify_tree(tokens, parents, logits, SamplingParams(0.0), None) == Verdict(1, 4, (0,))
    for seed in range(50):  # sampling too: the second 2 is never reached
        verdict = verify_tree(tokens, parents, logits, SamplingParams(1.0), torch.Generator().manual_seed(seed))
        assert 1 not in verdict.path and 2 not in verdict.path


@settings(max_examples=200, deadline=None)
@given(k=st.integers(0, 6), seed=st.integers(0, 2**31 - 1), vocab=st.integers(2, 10))
def test_a_chain_through_the_greedy_tree_rule_gets_the_chain_rules_verdict(k, seed, vocab):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, 4, (k + 1, vocab), generator=g).float()  # ties included
    draft = torch.randint(0, vocab, (k,), generator=g)
    chain = list(range(-1, k - 1))
    assert verify_tree(draft, chain, logits, SamplingParams(0.0), None) == verify_greedy(draft, logits)


@pytest.mark.parametrize("params", [SamplingParams(0.0), SamplingParams(1.0, top_k=2)])
def test_non_finite_logits_raise_in_any_row_of_a_tree(params):
    logits = one_hot_rows(1, 0, 0)
    logits[2, 3] = float("nan")  # after node 1, which the rule does not reach
    with pytest.raises(ValueError, match="NaN"):
        verify_tree(torch.tensor([1, 5]), [-1, -1], logits, params, torch.Generator().manual_seed(0))


def test_parents_must_come_before_their_children():
    for parents in ([0, -1], [-1, 1], [-2, -1], [-1]):
        with pytest.raises(ValueError, match="parents"):
            verify_tree(torch.tensor([1, 2]), parents, one_hot_rows(1, 2, 3), SamplingParams(0.0), None)


# --- the tree rule's law, by G-test ---


def decode_with(rule, target: Table, tree_of, params: SamplingParams, generator, length: int) -> list[int]:
    """Decode `length` tokens after the empty context, a tree (tree_of(context)) per step."""
    context: tuple = ()
    while len(context) < length:
        tokens, parents, logits = tree_of(context)
        verdict = rule(tokens, parents, logits, params, generator)
        context += tuple(tokens[list(verdict.path)].tolist()) + (verdict.next_token,)
    return list(context[:length])


def trees_over(target: Table, draft: Table, depth: int, branching: int, duplicate: bool = False):
    """tree_of(context) -> tokens, parents, target logits [n + 1, vocab]: the draft's top tree, memoised."""
    made: dict[tuple, tuple] = {}

    def tree_of(context: tuple):
        if context not in made:
            tokens, parents, paths = top_tree(draft, context, depth, branching, duplicate=duplicate)
            logits = torch.stack([target.logits(context)] + [target.logits(context + p) for p in paths])
            made[context] = (torch.tensor(tokens, dtype=torch.long), parents, logits)
        return made[context]

    return tree_of


def tree_samples(rule, depth, branching, params, seed=0, duplicate=False, target_seed=1):
    target = Table(target_seed)
    draft = Table(target_seed + 100, scale=1.0, base=target)  # agrees often: paths are accepted deep
    tree_of = trees_over(target, draft, depth, branching, duplicate)
    generator = torch.Generator().manual_seed(seed)
    length = 2 * WINDOW
    samples = [decode_with(rule, target, tree_of, SamplingParams(**params), generator, length) for _ in range(SAMPLES)]
    return samples, exact_windows(target, (), params, length), exact_windows(draft, (), params, length)


TREE_CASES = [
    # depth, branching, sampling params
    (1, 4, dict(temperature=1.0)),
    (2, 1, dict(temperature=0.7, top_p=0.9)),
    (2, 2, dict(temperature=0.7, top_k=5)),
    (2, 4, dict(temperature=1.0, top_p=0.8)),
    (4, 1, dict(temperature=1.0, top_k=6)),
    (4, 2, dict(temperature=0.7, top_k=6, top_p=0.9)),
    (4, 4, dict(temperature=1.0)),
]


@pytest.mark.parametrize(
    "depth,branching,params",
    TREE_CASES,
    ids=[f"depth{d}-branching{b}-{'-'.join(f'{k}{v}' for k, v in p.items())}" for d, b, p in TREE_CASES],
)
def test_the_tree_rule_keeps_the_targets_law(depth, branching, params):
    """Tokens 1-2 and 3-4 jointly: a step may emit both of a window, or each from another step."""
    samples, exact, draft_law = tree_samples(verify_tree, depth, branching, params)
    for start, probs in exact.items():
        counts = window_counts(samples, start)
        assert g_test_pvalue(counts, probs) > ALPHA, start
    # negative control: the same samples are not the draft's law
    assert g_test_pvalue(window_counts(samples, 0), draft_law[0]) < ALPHA


def test_a_duplicate_child_is_never_reached_and_the_law_is_kept():
    """Each node's first child's token again, as its last child: the rule never reaches it,
    so the samples are those of the trees without it, draw for draw."""
    params = dict(temperature=1.0, top_k=8)
    samples, exact, _ = tree_samples(verify_tree, 2, 2, params, seed=3, duplicate=True)
    assert samples == tree_samples(verify_tree, 2, 2, params, seed=3)[0]
    for start, probs in exact.items():
        assert g_test_pvalue(window_counts(samples, start), probs) > ALPHA, start


def test_the_g_tests_see_trees_accepted_deep():
    """The tested trees are accepted past depth 1 often enough that a wrong row (a node's
    parent's, a sibling's) would show in the second token's law."""
    target = Table(1)
    tree_of = trees_over(target, Table(101, scale=1.0, base=target), 4, 2)
    generator = torch.Generator().manual_seed(0)
    depths = []
    for _ in range(500):
        tokens, parents, logits = tree_of(())
        depths.append(verify_tree(tokens, parents, logits, SamplingParams(0.7, top_k=6), generator).num_accepted)
    assert np.mean([d >= 2 for d in depths]) > 0.1 and max(depths) == 4


def follow_the_likeliest_child(tokens, parents, logits, params, generator):
    """Wrong: follows the child the target gives the most probability (if any), instead of drawing."""
    node, path = -1, []
    while True:
        p = logits_to_probs(logits[node + 1], params)
        children = [i for i, parent in enumerate(parents) if parent == node]
        if children:
            best = max(children, key=lambda c: float(p[tokens[c]]))
            if p[tokens[best]] > 0:
                node = best
                path.append(best)
                continue
        return Verdict(len(path), int(sample(p, generator)), tuple(path))


def specinfer_with_a_made_up_q(tokens, parents, logits, params, generator):
    """Wrong for deterministic children: SpecInfer's multi-round rule as if the children had
    been drawn from q, uniform over them: child x kept with probability min(1, p(x) / q(x)),
    else p <- norm(max(0, p - q)) and the next child is tried; then a draw from what is left."""
    node, path = -1, []
    while True:
        p = logits_to_probs(logits[node + 1], params).double()
        children = [i for i, parent in enumerate(parents) if parent == node]
        q = torch.zeros_like(p)
        for c in children:
            q[tokens[c]] = 1.0 / len(children)
        for c in children:
            x = int(tokens[c])
            if float(torch.rand(1, generator=generator)) < min(1.0, float(p[x] / q[x])):
                node = c
                path.append(c)
                break
            residual = (p - q).clamp(min=0)
            p = residual / residual.sum() if residual.sum() > 0 else p
        else:
            return Verdict(len(path), int(sample(p.float(), generator)), tuple(path))


@pytest.mark.parametrize("rule", [follow_the_likeliest_child, specinfer_with_a_made_up_q])
def test_negative_controls_wrong_tree_rules_are_caught(rule):
    samples, exact, _ = tree_samples(rule, 2, 2, dict(temperature=1.0))
    assert g_test_pvalue(window_counts(samples, 0), exact[0]) < ALPHA


# --- the decoder's tree steps ---


def table_engine(table: Table, drafter, k: int, runner_class=TableRunner, adaptive: bool = False):
    return SpeculativeEngine(runner_class(table), drafter=drafter, num_speculative_tokens=k, adaptive=adaptive)


def table_truth(table: Table, depth: int = 8):
    return lambda context: table.greedy(context, depth)


def spy_keeps(engine) -> list[tuple]:
    """Record every SlotPool.keep the decoder makes (then makes it)."""
    calls: list[tuple] = []
    keep = engine.decoder.slots.keep

    def spy(slot, start, offsets):
        calls.append((slot, start, list(offsets)))
        keep(slot, start, offsets)

    engine.decoder.slots.keep = spy
    return calls


TABLE_PROMPTS = [list(PROMPT), [1, 1, 4, 9, 6, 9, 4], [10, 3, 10, 3, 10]]


@pytest.mark.parametrize("k", [3, 8, 16])
def test_greedy_tree_decoding_is_the_targets_greedy_text(k):
    table = Table(7)
    expected = [table.greedy(tuple(p), 40) for p in TABLE_PROMPTS]
    drafter = TreeDrafter(oracle_trees(table_truth(table), table.vocab))
    engine = table_engine(table, drafter, k)  # k pinned: adaptive off
    keeps = spy_keeps(engine)
    results = engine.generate(TABLE_PROMPTS, max_new_tokens=40)
    assert [r.token_ids for r in results] == expected
    assert sum(r.stats.tree_steps for r in results) > 0
    assert sum(r.stats.accepted_tokens for r in results) > 0  # tree drafts verified and kept
    assert any(offsets != list(range(len(offsets))) for _, _, offsets in keeps)  # paths moved in the cache
    batched = engine.generate(TABLE_PROMPTS, max_new_tokens=40, max_batch_size=3)
    assert [r.token_ids for r in batched] == expected


def test_a_tree_step_keeps_the_accepted_path_and_counts_its_depth():
    """One step by hand: root 2 (the prompt's last), tree 0:(a) 1:(b) 2:(c under b); the
    target's greedy text is b c ...: the path (1, 2) is kept at the positions after the root."""
    table = Table(3)
    prompt = (4, 2)
    b, c, d = table.greedy(prompt, 3)  # b comes from the prompt's prefill; then the root is b
    a = next(t for t in range(table.vocab) if t != c)
    drafter = TreeDrafter(lambda context, k: ([a, c, d][:k], [-1, -1, 1][:k]))
    engine = table_engine(table, drafter, 3)
    keeps = spy_keeps(engine)
    result = engine.generate([list(prompt)], max_new_tokens=5)[0]  # prefill, one tree step, one token
    assert result.token_ids == table.greedy(prompt, 5)
    # step 2 verified [b, a, c, d] written after the 2 cached prompt tokens: b, c, d kept
    assert keeps == [(0, 2, [0, 2, 3])]
    assert drafter.records["observed"] == [(3, 2)]  # tree size, accepted depth
    stats = result.stats
    assert (stats.tree_steps, stats.tree_nodes, stats.tree_accepted_depth) == (1, 3, 2)
    assert stats.tree_histogram == {3: 1} and stats.drafted_histogram == {0: 2, 3: 1}
    # nodes by depth (two children of the root, one below), the accepted path by depth
    assert stats.drafted_per_position == [2, 1, 0] and stats.accepted_per_position == [1, 1, 0]
    assert (stats.drafted_tokens, stats.accepted_tokens, stats.target_forwards) == (3, 2, 3)


def test_every_drafter_learns_the_targets_rows_after_each_verification():
    table = Table(5)
    records = {"observed": [], "learnt": [], "proposed": []}
    drafter = TreeDrafter(oracle_trees(table_truth(table), table.vocab, seed=3), records)
    engine = table_engine(table, drafter, 6)
    result = engine.generate([list(PROMPT)], max_new_tokens=20)[0]
    learnt = records["learnt"]
    assert len(learnt) == result.stats.target_forwards  # the prefill's too
    token_ids, draft, logits = learnt[0]
    assert token_ids == list(PROMPT) and len(draft) == 0 and logits.shape == (1, table.vocab)
    for token_ids, draft, logits in learnt:
        assert logits.shape == (len(draft) + 1, table.vocab)
        paths = [()]
        for token, parent in zip(draft.tokens.tolist(), draft.parent_list()):
            paths.append(paths[parent + 1] + (token,))
        for row, path in zip(logits, paths):  # row 0 after the root, row 1 + i after node i
            assert torch.equal(row, table.logits(tuple(token_ids) + path))
    assert any(not d.is_chain for _, d, _ in learnt[1:])


def test_a_target_that_cannot_verify_trees_runs_the_first_path():
    table = Table(7)
    drafter = TreeDrafter(oracle_trees(table_truth(table), table.vocab))
    engine = table_engine(table, drafter, 8, runner_class=ChainTableRunner)
    forwards: list[list[int]] = []
    forward = engine.decoder.slots.forward

    def spy(slots, token_ids, num_logits, *parents):
        assert not parents  # no parents are passed for chains
        if num_logits[0] == len(token_ids[0]):  # a decoding step (a prefill asks for one row)
            forwards.append(token_ids[0].tolist()[1:])  # its root, then its draft
        return forward(slots, token_ids, num_logits)

    engine.decoder.slots.forward = spy
    results = engine.generate(TABLE_PROMPTS, max_new_tokens=30)
    assert [r.token_ids for r in results] == [table.greedy(tuple(p), 30) for p in TABLE_PROMPTS]
    assert sum(r.stats.tree_steps for r in results) == 0 and sum(r.stats.accepted_tokens for r in results) > 0
    proposed = drafter.records["proposed"]
    assert [f for f in forwards if f] == [d.first_path().tokens.tolist() for d in proposed]
    assert any(len(d) > len(d.first_path()) for d in proposed)  # trees were cut to their first path


def test_sampled_tree_decoding_through_the_decoder_keeps_the_targets_law():
    """Seeded samples (k pinned) of a tree drafter: the generated tokens 1-2 and 3-4 against the
    exact law; the draft's law is rejected (negative control)."""
    params = dict(temperature=1.0, top_k=8)
    table = Table(11)
    draft = Table(111, scale=1.0, base=table)

    def trees(context, k):
        tokens, parents, _ = top_tree(draft, context, 3, 3, most=k)
        return tokens, parents

    engine = table_engine(table, TreeDrafter(trees), 8)
    keeps = spy_keeps(engine)
    # room for a whole tree after the prefill's token; the first 2 * WINDOW tokens are tested
    results = engine.generate([list(PROMPT)] * 2000, max_new_tokens=10, seed=21, **params)
    samples = [r.token_ids for r in results]
    exact, draft_law = exact_windows(table, PROMPT, params, 2 * WINDOW), exact_windows(draft, PROMPT, params, 4)
    for start, probs in exact.items():
        assert g_test_pvalue(window_counts(samples, start), probs) > ALPHA, start
    assert g_test_pvalue(window_counts(samples, 0), draft_law[0]) < ALPHA
    assert sum(r.stats.tree_steps for r in results) > 0 and sum(r.stats.accepted_tokens for r in results) > 0
    assert keeps


@pytest.mark.parametrize("where", ["after the forward", "in a keep", "after a keep"])
def test_a_tree_step_that_fails_changes_nothing_and_its_retry_gives_the_same_output(where):
    """All or nothing with trees: a step that raises after its forward (the server's hook), in
    a keep before it moved anything, or after a keep moved a path, leaves every sequence as
    it was (tokens, cached length, stats, generator); retried, the seeded samples are the
    uninterrupted ones."""
    table = Table(13)
    drafter = TreeDrafter(oracle_trees(table_truth(table), table.vocab, seed=5))
    kwargs = dict(max_new_tokens=30, temperature=1.0, seed=4, max_batch_size=3)
    expected = [r.token_ids for r in table_engine(table, drafter, 6).generate(TABLE_PROMPTS, **kwargs)]

    engine = table_engine(table, drafter, 6)
    decoder, calls = engine.decoder, {"steps": 0, "keeps": 0}
    keep = decoder.slots.keep

    def flaky_keep(slot, start, offsets):
        calls["keeps"] += 1
        if where == "in a keep" and calls["keeps"] % 3 == 1:
            raise RuntimeError("injected fault in a keep")
        keep(slot, start, offsets)
        if where == "after a keep" and calls["keeps"] % 3 == 1:
            raise RuntimeError("injected fault after a keep")

    def after_forward():
        calls["steps"] += 1
        if where == "after the forward" and calls["steps"] % 4 == 3:
            raise RuntimeError("injected fault after the forward")

    decoder.slots.keep = flaky_keep
    settings = engine.settings(max_new_tokens=30, temperature=1.0, seed=4)
    from specdecode.engine import make_generator

    sequences = [engine.sequence(p, settings, make_generator(4 + i)) for i, p in enumerate(TABLE_PROMPTS)]
    waiting, failures = list(sequences), 0
    decoder.capacity = 3
    while waiting or decoder.active:
        while waiting and decoder.has_room:
            decoder.add(waiting.pop(0))
        before = [(list(s.tokens), s.cached, s.stats.to_dict(), s.generator.get_state()) for s in decoder.active]
        try:
            emitted = decoder.step(after_forward=after_forward)
        except RuntimeError:
            failures += 1
            after = [(list(s.tokens), s.cached, s.stats.to_dict(), s.generator.get_state()) for s in decoder.active]
            assert all(b[:3] == a[:3] and torch.equal(b[3], a[3]) for b, a in zip(before, after, strict=True))
            continue
        for seq, _ in emitted:
            if seq.finish is not None:
                decoder.remove(seq)
    assert failures >= 3
    assert [s.generated for s in sequences] == expected
    assert sum(s.stats.tree_steps for s in sequences) > 0


# --- on a real model: greedy equals transformers' generate ---


class PathwiseRunner(HFModelRunner):
    """transformers' runner verifying a tree by running each node's path alone from the cache
    (exact, slow: a reference); the cache then holds the new tokens as a chain, right for a
    path that is the chain prefix, and `keep` runs the kept tokens again."""

    verifies_trees = True

    def forward(self, token_ids, num_logits, parents=None):
        if parents is None:
            return super().forward(token_ids, num_logits)
        start, parent_list, rows = self.cache_length, parents.tolist(), []
        for i in range(len(parent_list)):
            path, node = [], i
            while node >= 0:
                path.insert(0, node)
                node = parent_list[node]
            self.crop(start)
            rows.append(super().forward(token_ids[path], 1))
        self.crop(start)
        super().forward(token_ids, 1)
        self.written = (start, token_ids)
        return torch.cat(rows)[len(parent_list) - num_logits :]

    def keep(self, start, offsets):
        written_at, token_ids = self.written
        assert written_at == start
        self.crop(start)
        super().forward(token_ids[offsets], 1)


def llama_truth(target, prompts, new_tokens):
    expected = {tuple(p): hf_greedy(target, p, new_tokens) for p in prompts}

    def truth(context: tuple) -> list[int]:
        for prompt, out in expected.items():
            done = context[len(prompt) :]
            if context[: len(prompt)] == prompt and tuple(out[: len(done)]) == done:
                return out[len(done) : len(done) + 6]
        return []

    return expected, truth


def fast_llama(seed: int, vocab_size: int = VOCAB, init: float = 0.6) -> torch.nn.Module:
    """A float32 Llama with head_dim 64, which the fast runner's tree attention kernel takes."""
    return head64_llama(seed, torch.float32, vocab_size, initializer_range=init)


def fast_tree_runner(model):
    runner = FastLlamaRunner(model)
    if not getattr(runner, "verifies_trees", False):
        pytest.skip("FastLlamaRunner does not verify trees yet (verifies_trees)")
    return runner


@pytest.mark.parametrize("runner", ["transformers (pathwise)", "fast"])
def test_greedy_tree_decoding_equals_transformers_generate_on_a_tiny_llama(runner):
    # the fast runner's tree kernel takes head_dim 64 (the default model's), not the tiny 8
    target = tiny_llama(seed=1) if runner.startswith("transformers") else fast_llama(seed=1)
    expected, truth = llama_truth(target, GREEDY_PROMPTS, 30)
    target_runner = PathwiseRunner(target) if runner.startswith("transformers") else fast_tree_runner(target)
    drafter = TreeDrafter(oracle_trees(truth, 24))
    engine = SpeculativeEngine(target_runner, drafter=drafter, num_speculative_tokens=8)  # k pinned
    keeps = spy_keeps(engine)
    results = engine.generate(GREEDY_PROMPTS, max_new_tokens=30)
    assert [r.token_ids for r in results] == [expected[tuple(p)] for p in GREEDY_PROMPTS]
    assert sum(r.stats.tree_steps for r in results) > 0
    assert sum(r.stats.accepted_tokens for r in results) > 0 and sum(r.stats.tree_accepted_depth for r in results) > 0
    assert any(offsets != list(range(len(offsets))) for _, _, offsets in keeps)
    if runner == "fast":
        batched = engine.generate(GREEDY_PROMPTS, max_new_tokens=30, max_batch_size=3)
        assert [r.token_ids for r in batched] == [expected[tuple(p)] for p in GREEDY_PROMPTS]


# a weight scale at which the head-dim-64 Llama's next-token law spreads over the vocabulary (its
# most likely pair of tokens well under a tenth), so that the G-test has cells to compare
SPREAD_INIT = 0.05


def test_sampled_tree_decoding_on_the_fast_runner_keeps_the_targets_law():
    """A head-dim-64 Llama on the fast runner's tree forward, k pinned, trees of a nearby
    model's guesses (its head perturbed) that the target often accepts two deep: new tokens 2-3
    against the exact law (helpers.exact_joint); the nearby model's law is rejected (negative
    control), so the test tells two close laws apart."""
    params = dict(temperature=1.0, top_k=8)
    target = fast_llama(seed=1, vocab_size=DIST_VOCAB, init=SPREAD_INIT)
    other = nearby_draft(target, noise=0.5)
    exact, wrong = exact_joint(target, params), exact_joint(other, params)
    assert exact.max() < 0.1  # spread out: many cells of the G-test expect 5 or more samples
    drafter = TreeDrafter(first_step_trees(other, branching=3, seed=9))
    engine = SpeculativeEngine(fast_tree_runner(target), drafter=drafter, num_speculative_tokens=6)
    keeps = spy_keeps(engine)
    depths = spy_depths(engine)
    counts = sample_counts(engine, 6, params, seed=17)
    assert g_test_pvalue(counts, exact) > ALPHA
    assert g_test_pvalue(counts, wrong) < ALPHA
    assert keeps and any(not d.is_chain for d in drafter.records["proposed"])
    # the tested tokens came from trees' deeper rows too: paths of two nodes were accepted often
    assert sum(depth >= 2 for depth in depths) > 0.05 * helpers.SAMPLES


def spy_depths(engine) -> list[int]:
    """Record the accepted depth of every tree step the decoder verifies."""
    depths: list[int] = []
    decide = engine.decoder._decide

    def spy(seq, draft, logits):
        decision = decide(seq, draft, logits)
        if decision is not None and not draft.is_chain:
            depths.append(decision.verdict.num_accepted)
        return decision

    engine.decoder._decide = spy
    return depths


def first_step_trees(model, branching: int, seed: int):
    """Trees (a function of the context) of a model's guesses at the first speculative step,
    the one whose accepted path decides the tested tokens: after PROMPT and any first token,
    the model's `branching` likeliest tokens, each followed by its likeliest token after that
    (2 * branching nodes); random trees at the later steps (oracle_trees), which cost nothing."""
    contexts = torch.tensor([helpers.PROMPT + [t] for t in range(DIST_VOCAB)])  # [vocab, len + 1]
    with torch.no_grad():
        first = model(contexts).logits[:, -1].topk(branching).indices  # [vocab, branching]
        paths = torch.cat([contexts.repeat_interleave(branching, 0), first.reshape(-1, 1)], dim=1)
        second = model(paths).logits[:, -1].argmax(-1).view(DIST_VOCAB, branching)  # [vocab, branching]
    parents = [-1] * branching + list(range(branching))
    made = {tuple(c): first[i].tolist() + second[i].tolist() for i, c in enumerate(contexts.tolist())}
    later = oracle_trees(lambda context: [], DIST_VOCAB, seed=seed)

    def trees(context: tuple, k: int):
        if context in made:
            return made[context][:k], parents[:k]
        return later(context, k)

    return trees


# --- stats ---


def test_tree_steps_count_nodes_depth_and_sizes_and_chains_are_unchanged():
    stats = GenerationStats("trees", 8)
    stats.record_step(5, 2, depths=[1, 1, 2, 2, 3])  # 5 nodes, 3 deep, path 2 deep
    stats.record_step(3, 3)  # a chain of 3, all accepted
    stats.record_step(8, 0, depths=[1] * 8)
    assert (stats.drafted_tokens, stats.accepted_tokens, stats.target_forwards) == (16, 5, 3)
    assert (stats.tree_steps, stats.tree_nodes, stats.tree_accepted_depth) == (2, 13, 2)
    assert stats.tree_histogram == {5: 1, 8: 1} and stats.drafted_histogram == {5: 1, 3: 1, 8: 1}
    assert stats.drafted_per_position == [11, 3, 2, 0, 0, 0, 0, 0]  # nodes by depth, tokens by position
    assert sum(stats.drafted_per_position) == stats.drafted_tokens
    assert stats.accepted_per_position == [2, 2, 1, 0, 0, 0, 0, 0]
    assert stats.mean_tree_size == 6.5 and stats.mean_accepted_depth == 1.0
    assert stats.to_dict()["mean_accepted_depth"] == 1.0 and "2 tree steps" in stats.summary()
    assert "tree steps" not in GenerationStats("lookup", 4).summary()


# --- the tree-size policy in the decoder ---


def test_the_decoder_chooses_tree_sizes_for_drafters_of_trees_it_can_verify(monkeypatch):
    """Adaptive: a tree drafter on a tree-verifying target gets AdaptiveTree, whose sizes vary
    with what it measured (costs frozen), and the greedy text is the target's; on a target that
    cannot verify trees it gets AdaptiveK (it runs chains)."""
    table = Table(7)
    engine = table_engine(table, TreeDrafter(oracle_trees(table_truth(table), table.vocab)), 16, adaptive=True)
    engine.decoder.costs.seconds = {n: 0.010 + 0.001 * n for n in (1, 2, 4, 8, 16, 17)}
    monkeypatch.setattr(engine.decoder.costs, "record", lambda n, seconds: None)
    chosen = []
    choose = AdaptiveTree.choose

    def spy(self, k_max, batch_size=1):
        chosen.append(choose(self, k_max, batch_size))
        return chosen[-1]

    monkeypatch.setattr(AdaptiveTree, "choose", spy)
    results = engine.generate(TABLE_PROMPTS, max_new_tokens=40)
    assert [r.token_ids for r in results] == [table.greedy(tuple(p), 40) for p in TABLE_PROMPTS]
    assert isinstance(engine.decoder.policies["trees"], AdaptiveTree)
    assert len(set(chosen)) > 1 and sum(r.stats.tree_steps for r in results) > 0
    chains = table_engine(table, TreeDrafter(oracle_trees(table_truth(table), 12)), 8, ChainTableRunner, True)
    chains.generate(TABLE_PROMPTS[:1], max_new_tokens=10)
    assert type(chains.decoder.policies["trees"]) is AdaptiveK


def test_a_drafters_greedy_and_sampled_sequences_are_measured_by_policies_of_their_own():
    """A sampled sequence accepts less than a greedy one, so its steps must not move the greedy
    policy's measurements (nor the other way): each has a policy of its own (decoder.policy_key)."""
    table = Table(7)
    engine = table_engine(table, TreeDrafter(oracle_trees(table_truth(table), table.vocab)), 8, adaptive=True)
    engine.generate(TABLE_PROMPTS[:1], max_new_tokens=20)
    greedy = engine.decoder.policies["trees"]
    measured = dict(greedy.accepted)
    assert measured and set(engine.decoder.policies) == {"trees"}
    engine.generate(TABLE_PROMPTS[:1], max_new_tokens=20, temperature=1.0)
    sampled = engine.decoder.policies["trees, sampled"]
    assert sampled is not greedy and sampled.accepted
    assert greedy.accepted == measured  # the sampled steps left it as it was


def test_in_a_batch_one_sequence_a_step_explores_and_the_others_draft_the_settled_size(monkeypatch):
    """A policy that explores 4 nodes where 0 pays (a probe, or optimism): in a batch of three,
    one sequence a step drafts it, each in turn, and the others draft nothing; alone, the
    sequence explores every step. The text stays the target's."""

    def exploring(self, k_max, batch_size=1):
        self.settled = 0
        return 4

    monkeypatch.setattr(AdaptiveTree, "choose", exploring)
    table = Table(7)
    engine = table_engine(table, TreeDrafter(oracle_trees(table_truth(table), table.vocab)), 8, adaptive=True)
    asked: list[list[int]] = []
    draft = engine.decoder._draft

    def spy(sequences):
        drafts, ks = draft(sequences)
        asked.append(ks)
        return drafts, ks

    engine.decoder._draft = spy
    results = engine.generate(TABLE_PROMPTS, max_new_tokens=12, max_batch_size=3)
    assert [r.token_ids for r in results] == [table.greedy(tuple(p), 12) for p in TABLE_PROMPTS]
    batched = [ks for ks in asked if len(ks) == 3 and any(ks)]
    assert batched and all(sorted(ks)[:2] == [0, 0] for ks in batched)  # (4, or less where the budget ends)
    assert len({ks.index(max(ks)) for ks in batched}) == 3  # in turn
    asked.clear()
    engine.generate(TABLE_PROMPTS[:1], max_new_tokens=12)
    alone = [ks[0] for ks in asked[1:]]  # after the prefill: 4, or less where the budget ends
    assert alone[0] == 4 and 0 not in alone[:-1], alone  # the last step has no room to draft


# --- the server's tree metrics ---


def test_the_servers_tree_metrics_count_tree_steps_nodes_depth_and_sizes():
    """A finished request's tree steps reach /metrics: steps, nodes, accepted depth, the
    size histogram, with help text; a chain-only request adds nothing to them."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from specdecode.server.metrics import ServerMetrics

    metrics = ServerMetrics()
    trees = GenerationStats("recycling", 16)
    trees.record_step(5, 2, depths=[1, 1, 2, 2, 3])
    trees.record_step(16, 3, depths=[1] * 4 + [2] * 6 + [3] * 6)
    trees.record_step(3, 1)  # a chain step counts in none of them
    chains = GenerationStats("prompt-lookup", 4)
    chains.record_step(4, 4)
    for stats in (trees, chains):
        metrics.observe_finished("chat", stats, 10, 20)

    families = {f.name: f for f in text_string_to_metric_families(generate_latest(metrics.registry).decode())}
    value = {s.name: s.value for f in families.values() for s in f.samples if not s.labels or "le" in s.labels}
    assert value["specdecode:spec_decode_num_tree_steps_total"] == 2
    assert value["specdecode:spec_decode_num_tree_nodes_total"] == 21
    assert value["specdecode:spec_decode_tree_accepted_depth_total"] == 5
    assert value["specdecode:spec_decode_tree_size_count"] == 2 and value["specdecode:spec_decode_tree_size_sum"] == 21
    buckets = {
        s.labels["le"]: s.value for s in families["specdecode:spec_decode_tree_size"].samples if "le" in s.labels
    }
    assert (buckets["4.0"], buckets["8.0"], buckets["16.0"]) == (0, 1, 2)
    for name in ("num_tree_steps", "num_tree_nodes", "tree_accepted_depth", "tree_size"):
        assert families[f"specdecode:spec_decode_{name}"].documentation
