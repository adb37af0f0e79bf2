"""One request path: the request checks (core/checks.py) said once and shared by the engine,
the CLI and the server; one server configuration; the drafter chain a Drafter like the others."""

from __future__ import annotations

import inspect

import pytest
import torch
from typer.testing import CliRunner

from helpers import tiny_llama, tiny_tokenizer
from specdecode import SpeculativeEngine
from specdecode.core.checks import check_k, check_max_model_len, check_request, seeds_for
from specdecode.core.sampling import SamplingParams
from specdecode.drafters import AutoDrafter, Draft, Drafter, PromptLookupDrafter
from specdecode.errors import InvalidArgumentError
from specdecode.server.config import ServerConfig


@pytest.mark.parametrize(
    "request_fields,param",
    [
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(max_new_tokens=4, temperature=-1.0), "temperature"),
        (dict(max_new_tokens=4, top_p=0.0), "top_p"),
        (dict(max_new_tokens=4, stop=[""]), "stop"),
        (dict(max_new_tokens=4, seed=2**64), "seed"),
        (dict(max_new_tokens=4, num_speculative_tokens=3, most_k=2), "num_speculative_tokens"),
    ],
)
def test_the_engine_raises_the_checks_own_error_for_each_rule(request_fields, param):
    """The engine adds no wording of its own: the same rule, the same message."""
    with pytest.raises(InvalidArgumentError) as alone:
        check_request(**request_fields)
    engine = SpeculativeEngine(tiny_llama(seed=1), tiny_tokenizer(), num_speculative_tokens=2)
    fields = {name: value for name, value in request_fields.items() if name != "most_k"}
    with pytest.raises(InvalidArgumentError) as in_engine:
        engine.settings(**fields)
    assert alone.value.param == in_engine.value.param == param
    assert str(alone.value) == str(in_engine.value)


def test_the_cli_words_a_rule_as_the_engine_does_with_its_option_name(tiny_model_dir):
    from specdecode.cli import app

    result = CliRunner().invoke(app, ["generate", "w1", "--target", tiny_model_dir, "--max-new-tokens", "0"])
    with pytest.raises(InvalidArgumentError) as error:
        check_request(max_new_tokens=0)
    assert result.exit_code == 2
    assert f"--max-new-tokens{str(error.value).removeprefix('max_new_tokens')}" in result.stderr


def test_max_model_len_bounds_before_and_after_the_model_is_known():
    check_max_model_len(None)
    check_max_model_len(2)
    with pytest.raises(InvalidArgumentError, match="at least 2"):
        check_max_model_len(1)
    check_max_model_len(100, context=128)
    with pytest.raises(InvalidArgumentError, match=r"in \[2, 128\]"):
        check_max_model_len(129, context=128)
    with pytest.raises(InvalidArgumentError, match="at most 3 "):
        check_k(4, most=3)


def test_one_seeding_rule():
    assert seeds_for(None, 3) == [None, None, None]
    assert seeds_for(7, 3) == [7, 8, 9]


def test_every_public_entry_point_takes_its_settings_by_keyword():
    """Positional settings would let a reordering change a request silently."""
    engine = SpeculativeEngine(tiny_llama(seed=1), tiny_tokenizer())
    for method, positional in [
        (engine.generate, {"prompts"}),
        (engine.settings, set()),
        (SpeculativeEngine.from_pretrained, {"target"}),
        (engine.with_drafter, {"drafter", "num_speculative_tokens"}),
    ]:
        parameters = inspect.signature(method).parameters.values()
        assert {p.name for p in parameters if p.kind is not p.KEYWORD_ONLY} == positional, method.__name__


def test_a_batch_of_one_is_the_same_path_as_a_batch():
    engine = SpeculativeEngine(tiny_llama(seed=1), tiny_tokenizer(), PromptLookupDrafter(), num_speculative_tokens=3)
    prompts = ["w1 w2 w3 w1 w2", "w5 w6 w5"]
    sampled = dict(max_new_tokens=12, temperature=1.0, seed=4)
    one_at_a_time = [r.token_ids for r in engine.generate(prompts, **sampled)]
    together = [r.token_ids for r in engine.generate(prompts, **sampled, max_batch_size=2)]
    alone = [engine.generate([p], **sampled | dict(seed=4 + i))[0].token_ids for i, p in enumerate(prompts)]
    assert one_at_a_time == together == alone


class _Fixed(Drafter):
    """A drafter that proposes a fixed chain (or nothing) and records what it was told."""

    per_sequence = True
    depends_on_history = False
    drafts_trees = False

    def __init__(self, name: str, tokens: list[int]):
        self.name, self.tokens, self.observed, self.finished = name, tokens, [], []

    def begin(self, prompt_ids):
        pass

    def propose(self, token_ids, k, params, generator) -> Draft:
        return Draft(torch.tensor(self.tokens[:k], dtype=torch.long), None, source=self.name)

    def observe(self, num_drafted, num_accepted):
        self.observed.append((num_drafted, num_accepted))

    def finish(self, token_ids):
        self.finished.append(token_ids)

    def fork(self):
        return self


def test_the_drafter_chain_is_a_drafter_proposing_its_first_candidates_draft():
    silent, first, second = _Fixed("silent", []), _Fixed("first", [5, 6]), _Fixed("second", [7])
    chain = AutoDrafter([silent, first, second])
    draft = chain.propose([1, 2], 4, SamplingParams(), None)
    assert draft.tokens.tolist() == [5, 6] and draft.source == "first"
    chain.observe(2, 1)
    assert first.observed == [(2, 1)] and not silent.observed and not second.observed
    chain.finish([1, 2, 5])
    assert all(c.finished == [[1, 2, 5]] for c in (silent, first, second))
    assert not AutoDrafter([silent]).propose([1, 2], 4, SamplingParams(), None).tokens.numel()
    assert chain.per_sequence and not chain.depends_on_history and chain.fork().candidates == chain.candidates


def test_a_server_config_refuses_what_the_server_could_not_use():
    for field, value in [
        ("port", 0),
        ("max_waiting", 0),
        ("max_batch_size", 0),
        ("max_request_seconds", 0.0),
        ("kv_cache_gb", -1.0),
        ("num_speculative_tokens", -1),
        ("max_model_len", 1),
    ]:
        with pytest.raises(InvalidArgumentError) as error:
            ServerConfig(**{field: value})
        assert error.value.param == field
    assert ServerConfig(target="m").served_name == "m" and ServerConfig(model_name="x").served_name == "x"


def test_serve_takes_its_defaults_from_the_server_config():
    from specdecode.cli import serve

    defaults = ServerConfig()
    options = inspect.signature(serve).parameters
    for option, field in [
        ("target", "target"),
        ("k", "num_speculative_tokens"),
        ("host", "host"),
        ("port", "port"),
        ("max_waiting", "max_waiting"),
        ("max_batch_size", "max_batch_size"),
        ("max_request_seconds", "max_request_seconds"),
        ("adaptive", "adaptive"),
    ]:
        assert options[option].default == getattr(defaults, field), option
