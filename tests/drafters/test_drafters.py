"""Each drafter on its own: what it proposes, and that it changes nothing but speed."""

import json

import pytest
import torch

from helpers import adapting_on_acceptance, hf_greedy, nearby_draft, permuted_vocabulary, tiny_llama, tiny_tokenizer
from specdecode import SpeculativeEngine
from specdecode.core.sampling import SamplingParams
from specdecode.drafters import AutoDrafter, CrossTokenizerDrafter, ModelDrafter, PromptLookupDrafter
from specdecode.drafters.self_quantized import Int8Linear, quantized_copy, self_quantized_drafter
from specdecode.errors import InvalidArgumentError
from specdecode.runners import HFModelRunner

GREEDY = SamplingParams()


def propose(drafter, tokens, k=4):
    return drafter.propose(tokens, k, GREEDY, None).tokens.tolist()


def test_prompt_lookup_copies_after_the_longest_latest_match():
    lookup = PromptLookupDrafter(min_ngram=1, max_ngram=2)
    assert propose(lookup, [1, 2, 3, 9, 2, 3, 7, 8, 2, 3]) == [7, 8, 2, 3]  # "2 3" last seen before 7
    assert propose(lookup, [5, 6, 7, 6]) == [7, 6]  # the copy may run to the end of the sequence
    assert propose(lookup, [1, 2, 3]) == []


def test_prompt_lookup_options_cap_and_filter_matches():
    assert propose(PromptLookupDrafter(max_continuation=2), [1, 2, 3, 4, 5, 1, 2], k=4) == [3, 4]
    assert propose(PromptLookupDrafter(min_ngram=2, max_ngram=2), [1, 2, 3, 9, 3], k=4) == []
    with pytest.raises(InvalidArgumentError, match="min_ngram"):
        PromptLookupDrafter(min_ngram=3, max_ngram=2)


def test_prompt_lookup_searches_earlier_requests_only_when_enabled():
    for use_history, expected in [(False, []), (True, [7, 8])]:
        lookup = PromptLookupDrafter(min_ngram=2, use_history=use_history)
        lookup.begin([1, 2])
        propose(lookup, [1, 2, 5, 6, 7, 8])  # the first request ends with this text
        lookup.begin([4, 5, 6])
        assert propose(lookup, [4, 5, 6], k=2) == expected


def test_prompt_lookup_history_never_copies_across_requests():
    lookup = PromptLookupDrafter(min_ngram=2, use_history=True)
    for sequence in ([1, 2, 3], [4, 5]):
        lookup.begin(sequence)
        propose(lookup, sequence)
    lookup.begin([9, 2, 3])
    assert propose(lookup, [9, 2, 3]) == []  # "2 3" ended the first request: nothing follows it


def test_model_drafter_stops_after_a_token_it_is_unsure_of():
    model = tiny_llama(seed=1, init=0.02)  # small weights: flat distributions, max q ~ 1 / vocab
    assert len(propose(ModelDrafter(HFModelRunner(model)), [3, 5, 7])) == 4
    assert len(propose(ModelDrafter(HFModelRunner(model), min_confidence=0.5), [3, 5, 7])) == 1


@pytest.mark.parametrize("quantization", ["bfloat16", "int8"])
def test_quantized_copy_stays_close_to_the_target(quantization):
    target = tiny_llama(seed=1)
    draft = quantized_copy(target, quantization)
    ids = torch.tensor([[3, 5, 7, 2, 9]])
    with torch.no_grad():
        expected, got = target(ids).logits, draft(ids).logits.float()
    assert (got - expected).abs().max() < 0.05 * expected.abs().max()
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.8
    assert target.model.layers[0].self_attn.q_proj.weight.dtype == torch.float32  # the target is untouched
    if quantization == "int8":
        assert isinstance(draft.model.layers[0].mlp.up_proj, Int8Linear)


def test_self_quantized_drafter_is_mostly_accepted():
    target = tiny_llama(seed=1)
    engine = SpeculativeEngine(target, drafter=self_quantized_drafter(target, "bfloat16"), num_speculative_tokens=4)
    stats = engine.generate([[3, 5, 7, 2]], max_new_tokens=40)[0].stats
    assert stats.drafter == "self-quantized-bfloat16"
    assert stats.acceptance_rate > 0.8


def test_cross_tokenizer_drafter_translates_through_text():
    target, tokenizer = tiny_llama(seed=1), tiny_tokenizer()
    draft, draft_tokenizer = permuted_vocabulary(target)
    drafter = CrossTokenizerDrafter(HFModelRunner(draft), draft_tokenizer, tokenizer)
    engine = SpeculativeEngine(target, tokenizer, drafter, num_speculative_tokens=4)
    result = engine.generate([[3, 5, 7, 2]], max_new_tokens=40)[0]
    # the same model under other ids: every draft is the target's own next token
    assert result.stats.acceptance_rate == 1.0
    assert draft_tokenizer("w1").input_ids != tokenizer("w1").input_ids


def test_auto_tries_its_candidates_in_order_and_records_the_source():
    target = tiny_llama(seed=1)
    auto = AutoDrafter([PromptLookupDrafter(min_ngram=3), ModelDrafter(HFModelRunner(nearby_draft(target, 0.3)))])
    engine = SpeculativeEngine(target, drafter=auto, num_speculative_tokens=3)
    stats = engine.generate([[3, 5, 7, 3, 5, 7, 3, 5, 7]], max_new_tokens=30)[0].stats
    assert stats.drafter == "auto"
    assert set(stats.drafted_by_source) <= {"prompt-lookup", "model"} and "model" in stats.drafted_by_source
    assert sum(d for d, _ in stats.drafted_by_source.values()) == stats.drafted_tokens


def test_adaptive_auto_gives_up_a_useless_draft_model(monkeypatch):
    target = tiny_llama(seed=1)
    useless = ModelDrafter(HFModelRunner(tiny_llama(seed=99)))
    engine = SpeculativeEngine(target, drafter=useless, num_speculative_tokens=4, adaptive=True)
    adapting_on_acceptance(engine, monkeypatch)  # costs frozen: acceptance, not the clock, decides
    stats = engine.generate([[3, 5, 7, 2]], max_new_tokens=60)[0].stats
    assert stats.k_policy == "adaptive"
    assert stats.drafted_histogram.get(0, 0) > stats.target_forwards / 2  # mostly target-only steps
    assert stats.drafted_tokens < 30


def test_drafters_that_need_a_draft_model_say_so():
    for name in ("model", "cross-tokenizer"):
        with pytest.raises(InvalidArgumentError, match="needs a draft model"):
            SpeculativeEngine.from_pretrained("unused", drafter=name)
    with pytest.raises(InvalidArgumentError, match="quantization"):
        quantized_copy(tiny_llama(seed=1), "int4")


def test_cli_builds_drafters_from_its_options(tiny_model_dir):
    from typer.testing import CliRunner

    from specdecode.cli import app

    args = ["generate", "w1 w2 w3 w1 w2", "--target", tiny_model_dir, "--max-new-tokens", "12", "--json"]
    for extra, drafter, policy in [
        (
            ["--drafter", "prompt-lookup", "--fixed-k", "--ngram", "1", "2", "--lookup-history"],
            "prompt-lookup",
            "fixed",
        ),
        (
            ["--drafter", "self-quantized", "--draft-quantization", "int8", "--min-confidence", "0.2"],
            "self-quantized-int8-weight-only",  # int8, the older spelling, names int8-weight-only
            "adaptive",
        ),
    ]:
        result = CliRunner().invoke(app, args + extra)
        assert result.exit_code == 0, result.output
        stats = json.loads(result.stdout)["stats"]
        assert (stats["drafter"], stats["k_policy"]) == (drafter, policy)
        assert sum(stats["drafted_histogram"].values()) == stats["target_forwards"]


@pytest.mark.parametrize("kind", ["model", "cross-tokenizer"])
def test_a_draft_with_a_shorter_context_stops_drafting_at_its_end(kind):
    """A draft whose context (16 positions) ends long before the target's (128): it drafts while
    it can, then proposes nothing, and the output is still the target's own greedy output."""
    target = tiny_llama(seed=1)
    short = tiny_llama(seed=1, max_positions=16)
    short.load_state_dict(target.state_dict())  # the same weights: its drafts are accepted
    if kind == "model":
        drafter = ModelDrafter(HFModelRunner(short))
    else:
        draft, draft_tokenizer = permuted_vocabulary(short)
        drafter = CrossTokenizerDrafter(HFModelRunner(draft), draft_tokenizer, tiny_tokenizer())
    engine = SpeculativeEngine(target, drafter=drafter, num_speculative_tokens=4)
    prompt = [3, 5, 7, 2, 9, 4]
    result = engine.generate([prompt], max_new_tokens=40)[0]
    assert result.token_ids == hf_greedy(target, prompt, 40)
    assert result.stats.accepted_tokens >= 5  # drafted while the draft's context lasted
    assert result.stats.drafted_histogram.get(0, 0) > 20  # then only target steps


def test_lookup_history_reaches_the_sequences_of_batches_and_the_next_call():
    """Batched sequences (and the server's requests) run on forks of the drafter: the text each
    finished with must reach the history that every fork searches."""
    target = tiny_llama(seed=1)
    first = [3, 5, 7, 2]
    answer = SpeculativeEngine(target).generate([first], max_new_tokens=30, speculative=False)[0].token_ids
    replay = first + answer[:12]  # continues as the first answer did: only the history holds the rest

    def accepted(use_history: bool) -> int:
        engine = SpeculativeEngine(target, drafter=PromptLookupDrafter(2, 3, use_history=use_history))
        engine.generate([first, [20, 3, 20, 3]], max_new_tokens=30, max_batch_size=2)
        result = engine.generate([replay], max_new_tokens=12, max_batch_size=8)[0]
        assert result.token_ids == answer[12:24]
        return result.stats.accepted_tokens

    assert accepted(use_history=True) > accepted(use_history=False) + 4


def test_a_draft_model_prefills_the_prompt_at_begin_not_in_its_first_draft():
    """Timed as drafting, the prefill made every request's first draft look several times
    dearer than the next ones to adaptive k; now the first draft runs the new positions only."""
    runner = HFModelRunner(tiny_llama(seed=1))
    drafter, prompt = ModelDrafter(runner), [3, 5, 7, 2, 9, 11]
    drafter.begin(prompt)
    assert runner.cache_length == len(prompt) - 1
    ran = []
    forward = runner.forward
    runner.forward = lambda tokens, n: ran.append(len(tokens)) or forward(tokens, n)
    drafter.propose(prompt + [4], 3, SamplingParams(), None)
    assert ran == [2, 1, 1]  # the prompt's last token and the new one, then a draft token each


def test_every_drafter_declares_whether_it_drafts_trees_and_learns():
    from specdecode.cache import DraftStore
    from specdecode.cache.backends import InProcessBackend
    from specdecode.drafters.base import Draft
    from specdecode.drafters.recycling import RecyclingDrafter
    from specdecode.drafters.suffix import SuffixDrafter

    target = tiny_llama(seed=1)
    draft, draft_tokenizer = permuted_vocabulary(target)
    store = DraftStore(InProcessBackend(), "test", 24)
    drafters = {
        PromptLookupDrafter(): False,
        PromptLookupDrafter(tree=True): True,
        RecyclingDrafter(24): True,
        SuffixDrafter(store): False,
        ModelDrafter(HFModelRunner(target)): False,
        ModelDrafter(HFModelRunner(target), tree=True): True,
        self_quantized_drafter(target, "bfloat16"): False,
        CrossTokenizerDrafter(HFModelRunner(draft), draft_tokenizer, tiny_tokenizer()): False,
    }
    for drafter, trees in drafters.items():
        assert drafter.drafts_trees is trees, drafter.name
        drafter.learn([3, 5], Draft(torch.tensor([7]), None), torch.randn(2, 24))  # all take the hook


def test_auto_drafts_recycling_trees_first_where_the_target_verifies_trees():
    from specdecode.drafters.factory import DrafterOptions, make_drafter
    from specdecode.drafters.recycling import RecyclingDrafter

    target = tiny_llama(seed=1)
    runner = HFModelRunner(target)
    chains = make_drafter("auto", nearby_draft(target, 0.3), runner, None, None, "transformers", DrafterOptions())
    assert [c.name for c in chains.candidates] == ["prompt-lookup", "model"]  # as before
    assert not any(c.drafts_trees for c in chains.candidates)
    runner.verifies_trees = True  # as the fast runner declares where its tree kernel runs
    auto = make_drafter(
        "auto", nearby_draft(target, 0.3), runner, None, None, "transformers", DrafterOptions(recycling_width=4)
    )
    recycling, lookup, model = auto.candidates
    assert isinstance(recycling, RecyclingDrafter) and recycling.tree and recycling.width == 4
    assert recycling.lookup.drafts_trees and lookup.drafts_trees and model.drafts_trees
    assert auto.drafts_trees and not auto.per_sequence  # a draft model: batches of one sequence
    only_lookup = make_drafter("auto", None, runner, None, None, "transformers", DrafterOptions())
    assert [c.name for c in only_lookup.candidates] == ["recycling", "prompt-lookup"]
    # seeded samples skip recycling (its table depends on history): the lookup tree drafts for them
    assert recycling.depends_on_history and not lookup.depends_on_history


def test_the_recycling_width_is_checked():
    from specdecode.drafters.factory import DrafterOptions

    for width in (0, -1, 2.5, True):
        with pytest.raises(InvalidArgumentError, match="recycling_width"):
            SpeculativeEngine.from_pretrained(
                "unused", drafter="recycling", options=DrafterOptions(recycling_width=width)
            )
