"""Drafters that propose trees: the shared trie builder and tree shape, Token Recycling's table,
prompt lookup's and a draft model's trees, and recycling end to end (it changes nothing but speed)."""

import heapq
import itertools
import json

import pytest
import torch

from helpers import VOCAB, head64_llama, hf_greedy, tiny_llama
from specdecode import SpeculativeEngine
from specdecode.core.sampling import SamplingParams
from specdecode.drafters import ModelDrafter, PromptLookupDrafter
from specdecode.drafters.base import Draft
from specdecode.drafters.factory import DrafterOptions, make_drafter
from specdecode.drafters.recycling import (
    LOOKUP_ACCEPTANCE,
    RANK_ACCEPTANCE,
    RecyclingDrafter,
    TokenTable,
    top_candidates,
)
from specdecode.drafters.tree import TreeBuilder, chain_share, path_chances, tree_shape
from specdecode.runners import HFModelRunner

GREEDY = SamplingParams()


def tree_of(draft: Draft) -> tuple[list[int], list[int]]:
    return draft.tokens.tolist(), draft.parent_list()


# --- the trie builder ---


def test_the_builder_merges_paths_as_a_trie_within_its_budget():
    builder = TreeBuilder(6)
    assert builder.add_path([5, 6, 1]) == 2
    assert builder.add_path([5, 7]) == 3  # shares the 5, branches below it
    assert builder.add_path([5, 6, 1, 2]) == 4  # all but the last node were there
    assert builder.add_path([3, 4, 8, 9]) == 5  # the budget ends the path after one node
    assert builder.full and builder.child(-1, 9) is None  # no room for a new node
    assert builder.child(-1, 5) == 0  # an existing one is still found
    draft = builder.draft()
    assert tree_of(draft) == ([5, 6, 1, 7, 2, 3], [-1, 0, 1, 0, 2, -1])
    assert draft.first_path().tokens.tolist() == [5, 6, 1, 2]  # the first path added, extended
    assert draft.probs is None


def test_the_builder_gives_a_chain_when_no_node_branches():
    builder = TreeBuilder(8)
    builder.add_path([4, 3, 2])
    builder.add_path([4, 3])
    draft = builder.draft()
    assert draft.is_chain and draft.tokens.tolist() == [4, 3, 2]
    assert len(TreeBuilder(3).draft()) == 0


# --- the static shape ---


def test_the_shape_takes_the_nodes_most_likely_reached():
    # root's children rank 0 (0.5) and 1 (0.3); below rank 0 its rank 0 (0.25); then 0.15 twice:
    # rank 0 below the root's rank 1 was offered first
    assert tree_shape(4, ((0.5, 0.3),)) == ((-1, -1, 0, 1), (0, 1, 0, 0))
    assert tree_shape(3, ((0.9,),)) == ((-1, 0, 1), (0, 0, 0))  # one rank: a chain
    assert tree_shape(0, ((0.5,),)) == ((), ())
    # deeper levels their own: 0.5, then 0.45, 0.405, 0.3645 down the chain beat the root's 0.3
    assert tree_shape(4, ((0.5, 0.3), (0.9,))) == ((-1, 0, 1, 2), (0, 0, 0, 0))
    assert path_chances((-1, 0, 1, -1), (0, 0, 0, 1), ((0.5, 0.3), (0.9,))) == [0.5, 0.45, 0.5 * 0.9 * 0.9, 0.3]


@pytest.mark.parametrize("budget", [1, 2, 5, 8, 16, 33, 80])
def test_every_shape_is_topological_ranked_and_a_prefix_of_larger_ones(budget):
    parents, ranks = tree_shape(budget, RANK_ACCEPTANCE)
    assert len(parents) == budget
    assert all(p < i for i, p in enumerate(parents))
    for parent in set(parents):  # siblings come in rank order, with no rank skipped
        assert [r for p, r in zip(parents, ranks) if p == parent] == list(range(parents.count(parent)))
    larger = tree_shape(budget + 7, RANK_ACCEPTANCE)
    assert (larger[0][:budget], larger[1][:budget]) == (parents, ranks)
    chances = path_chances(parents, ranks, RANK_ACCEPTANCE)
    assert chances == sorted(chances, reverse=True)  # best first
    draft = Draft(torch.arange(budget), None, parents=torch.tensor(parents))
    assert max(draft.depths()) == len(draft.first_path())  # the rank-0 chain is the deepest path
    assert all(ranks[i] == 0 for i in range(budget) if i in _first_path_nodes(parents))


def _first_path_nodes(parents) -> set[int]:
    nodes, parent = set(), -1
    for i, p in enumerate(parents):
        if p == parent:
            nodes.add(i)
            parent = i
    return nodes


def test_the_shape_is_wide_at_the_root_and_narrows_deeper():
    parents, _ = tree_shape(80, RANK_ACCEPTANCE)
    depths = Draft(torch.arange(80), None, parents=torch.tensor(parents)).depths()
    per_level = [depths.count(d) for d in range(1, max(depths) + 1)]
    assert per_level[0] == len(RANK_ACCEPTANCE[0])  # every rank of the root
    assert per_level[-1] == 1 and max(per_level) > per_level[0]


def test_a_chain_takes_the_nodes_it_is_likelier_to_have_accepted():
    # chain 0.7, 0.49, 0.343 against the tree's 0.5, 0.3, 0.25, 0.15, ...
    assert chain_share(3, 0.7, ((0.5, 0.3),)) == 2
    assert chain_share(4, 0.7, ((0.5, 0.3),)) == 3
    assert chain_share(5, 0.99, ((0.5, 0.3),)) == 5
    assert chain_share(5, 0.1, ((0.5, 0.3),)) == 0


# --- the recycling table ---


def logits_with(tops: list[list[int]], vocab: int = VOCAB) -> torch.Tensor:
    """Logits [len(tops), vocab] whose rows rank tops[i] first, in that order."""
    logits = torch.zeros(len(tops), vocab)
    for row, top in zip(logits, tops):
        for rank, token in enumerate(top):
            row[token] = 10.0 - rank
    return logits


def recycling(width: int = 2, lookup: PromptLookupDrafter | None = None, **options) -> RecyclingDrafter:
    return RecyclingDrafter(VOCAB, width, lookup, rank_acceptance=((0.5, 0.3),), **options)


def test_recycling_drafts_the_table_breadth_first_and_learns_rejected_nodes_too():
    drafter = recycling()
    assert len(drafter.propose([3, 5], 4, GREEDY, None)) == 0  # nothing written: nothing proposed
    drafter.learn([3, 5], Draft.empty(), logits_with([[6, 7]]))  # a prefill: the row of 5
    assert tree_of(drafter.propose([3, 5], 4, GREEDY, None)) == ([6, 7], [-1, -1])  # rows 6, 7 unwritten
    # a verification of nodes 6 and 7 (siblings: one at most was accepted); both rows are written
    drafter.learn(
        [3, 5], Draft(torch.tensor([6, 7]), None, parents=torch.tensor([-1, -1])), logits_with([[6, 7], [8, 9], [3, 4]])
    )
    draft = drafter.propose([1, 5], 4, GREEDY, None)
    # shape (-1, -1, 0, 1) ranks (0, 1, 0, 0): 6, 7, then 6's best (8), then 7's best (3)
    assert tree_of(draft) == ([6, 7, 8, 3], [-1, -1, 0, 1])
    assert draft.first_path().tokens.tolist() == [6, 8]  # the table's greedy chain
    assert draft.probs is None


def test_recycling_as_a_chain_drafts_the_tables_greedy_chain():
    drafter = recycling(tree=False)
    drafter.learn([5], Draft(torch.tensor([6, 8]), None), logits_with([[6, 7], [8, 9], [2, 1]]))
    draft = drafter.propose([5], 4, GREEDY, None)
    assert draft.is_chain and draft.tokens.tolist() == [6, 8, 2]  # row 2 unwritten: it stops


def test_a_token_drafted_twice_writes_its_row_from_its_first_occurrence():
    table = TokenTable(VOCAB, 2)
    table.write([5, 6, 5], logits_with([[1, 2], [3, 4], [7, 8]]))
    assert table.ids[5].tolist() == [1, 2] and table.ids[6].tolist() == [3, 4]


def test_writes_applied_together_leave_the_table_as_one_at_a_time():
    """The table applies a step's writes (one per sequence) in one top-k when it is next read:
    the later write of a token wins, and within a write its first row, as applied one by one."""
    generator = torch.Generator().manual_seed(0)
    writes = [([5, 6, 5], torch.randn(3, 300, generator=generator)) for _ in range(4)]
    writes += [([7, 6], torch.randn(2, 300, generator=generator)), ([9], torch.randn(1, 300, generator=generator))]
    together, one_by_one = TokenTable(300, 8), TokenTable(300, 8)
    for rows, logits in writes:
        together.write(rows, logits)
        one_by_one.write(rows, logits)
        assert one_by_one.ids.shape == (301, 8)  # read, so applied now
    assert torch.equal(together.ids, one_by_one.ids)
    assert together.ids[6].tolist() == writes[4][1][1].topk(8).indices.tolist()  # the last write of 6
    assert together.ids[5].tolist() == writes[3][1][0].topk(8).indices.tolist()  # its write's first row


def test_the_table_is_shared_by_forks():
    drafter = recycling()
    fork = drafter.fork()
    fork.learn([2, 5], Draft.empty(), logits_with([[6, 7]]))
    assert drafter.propose([9, 5], 2, GREEDY, None).tokens.tolist() == [6, 7]
    assert fork.table is drafter.table and fork.rank_acceptance == drafter.rank_acceptance
    assert drafter.depends_on_history and drafter.per_sequence and drafter.drafts_trees


def test_recycling_holds_no_model():
    drafter = RecyclingDrafter(VOCAB, 8, PromptLookupDrafter(tree=True))
    held = [vars(drafter), vars(drafter.lookup), vars(drafter.table)]
    assert not any(
        isinstance(value, torch.nn.Module) or hasattr(value, "forward") for v in held for value in v.values()
    )
    assert drafter.table.ids.dtype == torch.int32 and tuple(drafter.table.ids.shape) == (VOCAB + 1, 8)


def test_recycling_puts_the_lookup_continuation_first_and_fills_the_rest_from_the_table():
    drafter = recycling(lookup=PromptLookupDrafter(min_ngram=2, max_ngram=2, tree=True))
    drafter.begin([3, 4, 9, 8, 3, 4])
    drafter.learn([4], Draft.empty(), logits_with([[9, 5]]))  # row 4: 9, 5
    drafter.learn([9], Draft.empty(), logits_with([[1, 2]]))  # row 9: 1, 2
    tokens = [3, 4, 9, 8, 3, 4]  # "3 4" was followed by 9 8 3 4
    draft = drafter.propose(tokens, 6, GREEDY, None)
    # before any verdict the continuation takes chain_share(6, LOOKUP_ACCEPTANCE, ...) = 2 nodes: 9 8;
    # the table's 9 (rank 0 of row 4) is the continuation's own first node, so the table's
    # children of 9 go below it (1, 2); then 5
    assert chain_share(6, LOOKUP_ACCEPTANCE, ((0.5, 0.3),)) == 2
    assert tree_of(draft) == ([9, 8, 5, 1, 2], [-1, 0, -1, 0, 0])
    assert draft.first_path().tokens.tolist() == [9, 8]  # the lookup's chain
    # the target predicted 9 after the root and 8 after 9: two lookup hits, the rate rises to
    # (2 + 2) / (4 + 2), so the continuation takes 3 nodes next
    drafter.learn(tokens, draft, logits_with([[9, 5], [8, 1], [7, 6], [7, 6], [7, 6], [7, 6]]))
    assert chain_share(6, 4 / 6, ((0.5, 0.3),)) == 3
    draft = drafter.propose(tokens, 6, GREEDY, None)
    # table: 9 (merged), 5, then 8 below 9 (merged), 7 below 5, 1 below 9; the budget ends there
    assert tree_of(draft) == ([9, 8, 3, 5, 7, 1], [-1, 0, 1, -1, 3, 0])


def test_the_two_stage_top_candidates_equal_torchs_topk():
    generator = torch.Generator().manual_seed(0)
    for vocab, rows in itertools.product((49152, 50257, 300), (1, 3, 17)):
        logits = torch.randn(rows, vocab, generator=generator)
        assert torch.equal(top_candidates(logits, 8), logits.topk(8, dim=-1).indices)


# --- prompt lookup trees ---


def test_prompt_lookup_tree_merges_several_continuations_latest_first():
    lookup = PromptLookupDrafter(min_ngram=1, max_ngram=2, tree=True)
    # "1 2" at 4 (then 5 6 1 2) and at 0 (then 3 4 1 2 ...)
    draft = lookup.propose([1, 2, 3, 4, 1, 2, 5, 6, 1, 2], 6, GREEDY, None)
    assert tree_of(draft) == ([5, 6, 1, 2, 3, 4], [-1, 0, 1, 2, -1, 4])
    # shorter n-grams fill what longer ones leave: "2" alone was also followed by 7
    draft = lookup.propose([2, 7, 9, 1, 2, 5, 1, 2], 5, GREEDY, None)
    assert tree_of(draft) == ([5, 1, 2, 7, 9], [-1, 0, 1, -1, 3])


def test_prompt_lookup_trees_first_path_is_its_chain():
    generator = torch.Generator().manual_seed(1)
    chain, tree = PromptLookupDrafter(1, 3), PromptLookupDrafter(1, 3, tree=True)
    differ = extended = 0
    for _ in range(200):
        tokens = torch.randint(0, 6, (int(torch.randint(2, 30, (1,), generator=generator)),), generator=generator)
        for k in (1, 4, 9):
            expected = chain.propose(tokens.tolist(), k, GREEDY, None)
            draft = tree.propose(tokens.tolist(), k, GREEDY, None)
            first, chain_tokens = draft.first_path().tokens.tolist(), expected.tokens.tolist()
            # a later continuation may extend a chain cut short by the sequence's end
            assert first[: len(chain_tokens)] == chain_tokens and len(draft) <= k
            assert len(chain_tokens) < k or first == chain_tokens
            differ += not draft.is_chain
            extended += len(first) > len(chain_tokens)
    assert differ > 100 and extended > 0  # the trees did branch


# --- draft model trees ---


def best_nodes_by_brute_force(model, context: list[int], k: int) -> list[tuple[float, tuple[int, ...]]]:
    """The k paths most likely under the model (product of its probabilities), by best-first
    search with a fresh forward for every path: what EAGLE-2's expansion finds when it expands
    and offers k nodes per level."""
    found, heap = [], [(-1.0, ())]
    while heap and len(found) < k + 1:
        negative, path = heapq.heappop(heap)
        if path:
            found.append((-negative, path))
        with torch.no_grad():
            probs = torch.softmax(model(torch.tensor([context + list(path)])).logits[0, -1].float(), -1)
        for token in range(probs.shape[0]):
            heapq.heappush(heap, (negative * float(probs[token]), path + (token,)))
    return found[:k]


def paths_of(draft: Draft) -> list[tuple[int, ...]]:
    paths: list[tuple[int, ...]] = []
    for token, parent in zip(draft.tokens.tolist(), draft.parent_list()):
        paths.append((paths[parent] if parent >= 0 else ()) + (token,))
    return paths


def test_a_draft_models_tree_holds_its_most_likely_paths_and_its_greedy_chain_first():
    model = tiny_llama(seed=3, init=0.2)
    context = [3, 5, 7, 2]
    k = 6
    drafter = ModelDrafter(HFModelRunner(model), tree=True, branching=k)
    drafter.begin(context)
    draft = drafter.propose(context, k, GREEDY, None)
    assert draft.probs is None and len(draft) == k and not draft.is_chain
    expected = best_nodes_by_brute_force(model, context, k)
    assert paths_of(draft) == [path for _, path in expected]  # most likely first: topological
    chain = ModelDrafter(HFModelRunner(model)).propose(context, k, GREEDY, None).tokens.tolist()
    first = draft.first_path().tokens.tolist()
    assert first == chain[: len(first)] and len(first) >= 1


def test_a_draft_model_drafts_chains_with_their_probabilities_when_sampling():
    model = tiny_llama(seed=3, init=0.2)
    drafter = ModelDrafter(HFModelRunner(model), tree=True, branching=2)
    draft = drafter.propose([3, 5, 7], 4, SamplingParams(temperature=1.0), torch.Generator().manual_seed(0))
    assert draft.is_chain and draft.probs is not None and len(draft) == 4


def test_a_draft_model_with_one_branch_drafts_its_greedy_chain():
    model = tiny_llama(seed=3, init=0.2)
    chain = ModelDrafter(HFModelRunner(model)).propose([3, 5, 7], 5, GREEDY, None).tokens.tolist()
    draft = ModelDrafter(HFModelRunner(model), tree=True, branching=1).propose([3, 5, 7], 5, GREEDY, None)
    assert draft.is_chain and draft.tokens.tolist() == chain


# --- end to end ---


def test_recycling_by_name_decodes_as_the_target_does_with_drafts_kept():
    """transformers' runner verifies no tree: `recycling` drafts the table's greedy chain."""
    target = tiny_llama(seed=0)
    engine = SpeculativeEngine(target, num_speculative_tokens=4, runner="transformers")  # no trees
    engine.drafter = make_drafter("recycling", None, engine.target_runner, None, None, "auto", DrafterOptions())
    assert isinstance(engine.drafter, RecyclingDrafter) and not engine.drafter.tree
    assert engine.drafter.width == 8 and engine.drafter.lookup is not None
    _assert_greedy_with_drafts_kept(engine, target)


def test_the_cli_drafts_with_recycling(tiny_model_dir):
    from typer.testing import CliRunner

    from specdecode.cli import app

    args = ["generate", "w1 w2 w3 w1 w2", "--target", tiny_model_dir, "--max-new-tokens", "12", "--json"]
    result = CliRunner().invoke(app, [*args, "--drafter", "recycling", "--fixed-k"])
    assert result.exit_code == 0, result.output
    stats = json.loads(result.stdout)["stats"]
    assert (stats["drafter"], stats["k_policy"]) == ("recycling", "fixed")
    assert sum(stats["drafted_histogram"].values()) == stats["target_forwards"]
    assert "recycling" in CliRunner().invoke(app, ["generate", "--help"]).output


def test_a_recycling_tree_on_a_target_that_verifies_none_runs_its_first_path():
    target = tiny_llama(seed=0)
    drafter = RecyclingDrafter(VOCAB, 8, PromptLookupDrafter(tree=True))
    _assert_greedy_with_drafts_kept(SpeculativeEngine(target, drafter=drafter, num_speculative_tokens=6), target)


def _assert_greedy_with_drafts_kept(engine: SpeculativeEngine, model) -> None:
    prompts = [[3, 5, 7, 2], [9, 4, 4, 11, 2, 8]]
    results = engine.generate(prompts, max_new_tokens=40)
    assert [r.token_ids for r in results] == [hf_greedy(model, prompt, 40) for prompt in prompts]
    assert {(r.stats.drafter, r.stats.k_policy) for r in results} == {("recycling", "fixed")}
    # drafts were verified and kept (a random model's next token depends on more than the last)
    assert sum(r.stats.accepted_tokens for r in results) >= 12, [r.stats for r in results]


def bfloat16_llama(seed: int = 0):
    """A Llama whose head_dim (64) the fast runner's tree attention kernel takes."""
    return head64_llama(seed)


def test_recycling_trees_verified_by_the_fast_runner_decode_as_target_only_decoding():
    from specdecode.decoder import Decoder
    from specdecode.runners.fast_llama import FastLlamaRunner

    engine = SpeculativeEngine(bfloat16_llama(), num_speculative_tokens=8)
    runner = engine.target_runner
    if not (isinstance(runner, FastLlamaRunner) and runner.verifies_trees and hasattr(Decoder, "_keep_path")):
        pytest.skip("the fast runner verifies no trees here (no tree attention kernel), or the decoder keeps no paths")
    engine.drafter = make_drafter("recycling", None, runner, None, None, "auto", DrafterOptions())
    assert engine.drafter.tree
    generator = torch.Generator().manual_seed(0)
    prompts = [p + p[:8] for p in (torch.randint(0, 256, (20,), generator=generator).tolist() for _ in range(3))]
    expected = [r.token_ids for r in engine.generate(prompts, max_new_tokens=60, speculative=False)]
    results = engine.generate(prompts, max_new_tokens=60)
    assert [r.token_ids for r in results] == expected
    assert sum(r.stats.accepted_tokens for r in results) >= 12, [r.stats for r in results]
    assert all(r.stats.tree_steps > 0 for r in results)  # trees were verified, not their first paths
