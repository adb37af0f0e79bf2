"""The fast Llama runner compiled by torch.compile keeps speculation exact.

What exactness needs holds compiled too: a verification forward gives each token the bits a
one-token forward gives it, so speculative decoding reproduces target-only decoding. Each
forward size compiles once; the cache length is a symbol, not a reason to compile again.
Compiling takes ~10 s a size even for these tiny models, so the tests here are few.
"""

import pytest
import torch
from test_fast_runners import half_precision_llama
from torch._dynamo.utils import counters
from typer.testing import CliRunner

from helpers import assert_drafted_and_accepted, verified_differs_from_alone
from specdecode import CacheOptions, DrafterOptions, SpeculativeEngine
from specdecode.cli import app
from specdecode.errors import InvalidArgumentError


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_verification_gives_each_token_its_logits_decoded_alone(dtype):
    runner = half_precision_llama(dtype, hidden=64, heads=4)
    runner.compile()
    graphs = counters["stats"]["unique_graphs"]
    # 14 prefills (eager), 6-token verifications and one-token forwards at 14 cache lengths
    assert verified_differs_from_alone(runner) == 0
    assert counters["stats"]["unique_graphs"] - graphs == 2  # one per size: 6 tokens and 1
    assert not runner.batch_invariant  # a batch runs eager kernels, which may round otherwise


def test_a_compiled_engine_speculates_exactly(tiny_model_dir):
    # k fixed: adaptive k, timing each size as it compiled, switched drafting off on a busy machine
    engine = SpeculativeEngine.from_pretrained(
        tiny_model_dir,
        drafter="prompt-lookup",
        num_speculative_tokens=3,
        compile=True,
        cache=CacheOptions(),
        options=DrafterOptions(adaptive=False),
    )
    assert engine.precision.endswith("compiled") and engine.response_cache is None
    prompts = ["w1 w2 w3 w1 w2 w3 w1 w2", "w5 w6 w5 w6 w5", "w9 w8 w7 w9 w8"]
    target_only = engine.generate(prompts, max_new_tokens=24, speculative=False)
    speculative = engine.generate(prompts, max_new_tokens=24)
    assert [r.token_ids for r in speculative] == [r.token_ids for r in target_only]
    assert_drafted_and_accepted(speculative)


def test_compile_is_refused_where_no_runner_can_compile(tiny_model_dir):
    with pytest.raises(InvalidArgumentError, match="compile runs on the Llama-family fast runner"):
        SpeculativeEngine.from_pretrained(tiny_model_dir, runner="transformers", compile=True)


def test_profile_refuses_to_compile_the_transformers_runner(tiny_model_dir):
    result = CliRunner().invoke(app, ["profile", "--target", tiny_model_dir, "--runner", "transformers", "--compile"])
    assert result.exit_code == 2 and "--compile times the fast runner" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
