"""w8a8's decoder layers in one C call a forward (kernels/int8_layer.py, csrc/int8_layer.c): a
token's logits are bitwise the same alone, in a verification chain, in a tree, among other
sequences' rows, and prefilled or decoded one at a time; its bits are its own (close to the
torch path's, and named apart in the response cache's fingerprint); without its library the
layers run on torch operations.

The paths are forced as tests/kernels/test_w8a8.py forces them: a runner whose `_int8_layers` is
None runs the torch path (the state of a runner where the library did not load), and a failing
`_build` stands for a machine without gcc. The tests run on every build of the kernels this CPU
runs (the `isa` fixture: AVX512-VNNI, AVX2, portable C), and the builds' logits are compared bit
for bit.
"""

import ctypes
import logging
from collections.abc import Iterator

import pytest
import torch

import helpers
from helpers import assert_drafted_and_accepted, head64_llama, same_bits
from helpers.bits import c_layers_run_here, every_kind_of_forward, forced_kernel_isa, kernel_isas
from specdecode import SpeculativeEngine
from specdecode.cache.response_cache import runner_variant
from specdecode.drafters import PromptLookupDrafter
from specdecode.kernels import int8_kernel, int8_layer
from specdecode.runners.fast_llama import FastLlamaRunner, Int8Recipe

EVERY_PRODUCT = Int8Recipe(keep_float=(), smoothing=0.0)


pytestmark = pytest.mark.skipif(not c_layers_run_here(), reason="no own w8a8 product or no gcc here")


@pytest.fixture(params=kernel_isas())
def isa(request) -> Iterator[str]:
    """Each build of the int8 kernels this CPU runs, forced for the test (helpers.bits)."""
    with forced_kernel_isa(request.param):
        yield request.param


def c_runner(recipe: Int8Recipe = EVERY_PRODUCT, seed: int = 0, dtype=torch.bfloat16, **config) -> FastLlamaRunner:
    runner = FastLlamaRunner(head64_llama(seed, dtype, **config), "w8a8", recipe)
    assert runner.layer_kernel is not None and runner.verifies_trees  # the C layers run
    assert runner._int8_layers._kernel.isa == int8_kernel.load().isa  # the build the products run
    return runner


def torch_runner(recipe: Int8Recipe = EVERY_PRODUCT, seed: int = 0, dtype=torch.bfloat16, **config) -> FastLlamaRunner:
    runner = FastLlamaRunner(head64_llama(seed, dtype, **config), "w8a8", recipe)
    runner._int8_layers = None  # as where int8_layer.load() gave None
    return runner


def tokens(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))


def verified_differs_from_alone(runner: FastLlamaRunner, n: int) -> int:
    return helpers.verified_differs_from_alone(runner, n, starts=range(10, 170, 40), length=200)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("n", [1, 8, 16])
def test_a_token_in_a_chain_gets_the_logits_of_decoding_it_alone(n, dtype, isa):
    assert verified_differs_from_alone(c_runner(Int8Recipe(), dtype=dtype), n) == 0


def test_biases_and_one_key_head_a_query_group(isa):
    """q|k|v and o biases (Llama's attention_bias, as Qwen2's q|k|v), and every query head on one
    key/value head: still row by row, and still the torch path's model."""
    config = dict(attention_bias=True, kv_heads=1)
    assert verified_differs_from_alone(c_runner(**config), 8) == 0
    ids = tokens(40)
    c, t = c_runner(**config).forward(ids, 40), torch_runner(**config).forward(ids, 40)
    assert (c - t).abs().max() <= 0.05 * t.abs().max()


def test_tree_nodes_get_the_logits_of_decoding_their_path_alone(isa):
    runner = c_runner()
    ids = tokens(60)
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, -1, 6, 3, 8, 4, 5])
    nodes = tokens(len(parents), seed=2)
    runner.forward(ids, 1)
    tree = runner.forward(nodes, len(nodes), parents)
    for i in range(len(nodes)):
        path, node = [], i
        while node >= 0:
            path.insert(0, node)
            node = int(parents[node])
        runner.crop(len(ids))
        alone = torch.cat([runner.forward(nodes[j : j + 1], 1) for j in path])[-1:]  # one token at a time
        assert torch.equal(tree[i : i + 1], alone), i


def test_a_prefill_gives_the_bits_of_decoding_its_tokens_one_at_a_time(isa):
    """Prefills run on the C layers too (the kernel's causal plan): the keys they write are those
    one-token decoding writes, so what later forwards read does not depend on how a prefix came."""
    runner = c_runner()
    ids = tokens(150)  # past the C file's 64-query attention chunks
    prefilled = runner.forward(ids, 3)
    runner.reset()
    one_at_a_time = torch.cat([runner.forward(ids[j : j + 1], 1) for j in range(len(ids))])[-3:]
    assert torch.equal(prefilled, one_at_a_time)


def test_sequences_of_a_batch_get_their_logits_alone(isa):
    """Three sequences in every forward: prefills beside each other, then a verification chain,
    one-token decoding and a tree in one forward."""
    runner = c_runner()
    prompts = [tokens(n, seed=s) for n, s in ((40, 3), (12, 4), (27, 5))]
    new = [tokens(5, seed=6), tokens(1, seed=7), tokens(4, seed=8)]
    tree = torch.tensor([-1, 0, 0, 1])

    def run(group: list[int]) -> list[torch.Tensor]:
        caches = [runner.new_cache() for _ in group]
        first = runner.forward_batch(caches, [prompts[i] for i in group], [2] * len(group))
        parents = [tree if i == 2 else None for i in group]
        second = runner.forward_batch(caches, [new[i] for i in group], [len(new[i]) for i in group], parents)
        return [torch.cat(pair) for pair in zip(first, second)]

    together = run([0, 1, 2])
    for i in range(3):
        assert torch.equal(run([i])[0], together[i]), i


def test_a_plan_that_lets_a_token_see_the_others_ties_it_to_them(monkeypatch, isa):
    """Negative control of the chain test: every new token attending to all of them."""

    def sees_every_new_token(length: int, n: int):
        return torch.full((n,), length + n, dtype=torch.int32), torch.empty(n, 0, dtype=torch.int32)

    monkeypatch.setattr(FastLlamaRunner, "_chain", staticmethod(sees_every_new_token))
    assert verified_differs_from_alone(c_runner(), 8) > 0


def _python_product(shared_scale: bool):
    """The C layers' product function, in Python: each row on its own scale (as the kernel), or
    one scale for all the rows of a product (the wrong quantization)."""
    kernel = int8_kernel.load()
    signature = ctypes.CFUNCTYPE(ctypes.c_int, *kernel._quantized_product.argtypes)

    def product(dtype, n, k, m, x, stride, packed, compensation, scales, bias, out, threads):
        assert dtype == int8_kernel.DTYPES[torch.bfloat16] and stride == k
        rows = torch.frombuffer((ctypes.c_uint16 * (n * k)).from_address(x), dtype=torch.bfloat16).view(n, k)
        codes, row_scales = kernel.quantize_rows(rows.clone())
        if shared_scale:  # one scale for every row: the largest
            scale = rows.float().abs().amax().clamp_min(1e-30) / 127.0
            codes = torch.round(rows.float() / scale).add_(128).to(torch.uint8)
            row_scales = scale.expand(n, 1).contiguous()
        return kernel._product(dtype, n, k, m, codes.data_ptr(), row_scales.data_ptr(), 1, packed, compensation,
                               scales, bias, out, 1)  # fmt: skip

    callback = signature(product)
    return callback, ctypes.cast(callback, ctypes.c_void_p).value


@pytest.mark.parametrize("shared_scale", [False, True], ids=["per-row-scale", "shared-scale"])
def test_a_scale_shared_by_the_rows_of_a_product_ties_a_token_to_the_others(shared_scale, isa):
    """Negative control through the C layers' own product call: with the kernel's quantization in
    Python the rows stay independent (so the wrapper is not what breaks them); one scale for the
    rows of a product makes verified tokens differ from decoding them alone."""
    runner = c_runner()
    callback, address = _python_product(shared_scale)
    runner._int8_layers._kernel = int8_layer.Int8Layers(runner._int8_layers._kernel._library, address, isa)
    differ = verified_differs_from_alone(runner, 8)
    assert (differ > 0) == shared_scale
    del callback


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_the_c_layers_are_the_torch_path_s_model_to_rounding(dtype, isa):
    """The same model: logits within rounding of the torch path's (in float32 not bit for bit:
    the rms norm sums and silu's exp are the C file's own)."""
    ids = tokens(60)
    c = c_runner(Int8Recipe(), dtype=dtype).forward(ids, 60)
    t = torch_runner(Int8Recipe(), dtype=dtype).forward(ids, 60)
    assert (c - t).abs().max() <= 0.05 * t.abs().max()
    assert (c.argmax(-1) == t.argmax(-1)).float().mean() >= 0.95
    if dtype == torch.float32:
        assert not torch.equal(c, t)  # other bits: the C layers did run


def test_speculation_equals_target_only_decoding_of_the_same_engine(isa):
    runner = c_runner(Int8Recipe())
    engine = SpeculativeEngine(runner, drafter=PromptLookupDrafter(), num_speculative_tokens=6)  # k pinned
    prompts = [[7, 8, 9, 10, 11, 7, 8, 9, 10, 11, 7, 8] * 3, list(range(40, 90)), [3, 1, 4, 1, 5, 9, 2, 6] * 4]
    target_only = [r.token_ids for r in engine.generate(prompts, max_new_tokens=60, speculative=False)]
    speculative = engine.generate(prompts, max_new_tokens=60)
    assert_drafted_and_accepted(speculative)
    assert [r.token_ids for r in speculative] == target_only
    batched = engine.generate(prompts, max_new_tokens=60, max_batch_size=3)
    assert_drafted_and_accepted(batched)
    assert [r.token_ids for r in batched] == target_only
    assert runner.layer_kernel is not None


def test_the_fingerprint_names_the_c_layers():
    assert runner_variant(c_runner()) != runner_variant(torch_runner())
    assert c_runner().layer_kernel == int8_layer.kernel_identity()


def test_without_the_library_the_layers_run_on_torch_operations(monkeypatch, caplog):
    def no_compiler(key: str, isa: str):
        raise RuntimeError("no gcc on PATH")

    ids, verified = tokens(40), tokens(8, seed=5)
    expected = torch_runner()
    expected = [expected.forward(ids, 3), expected.forward(verified, 8)]
    monkeypatch.setattr(int8_layer, "_loaded", {})
    monkeypatch.setattr(int8_layer, "_build", no_compiler)
    with caplog.at_level(logging.WARNING, logger="specdecode.kernels.int8_layer"):
        without = FastLlamaRunner(head64_llama(0, torch.bfloat16), "w8a8", EVERY_PRODUCT)
    assert caplog.text.count("int8 decoder layer kernel unavailable") == 1
    assert without.layer_kernel is None and without.verifies_trees
    assert torch.equal(without.forward(ids, 3), expected[0]) and torch.equal(without.forward(verified, 8), expected[1])
    assert verified_differs_from_alone(without, 8) == 0
    assert runner_variant(without) == runner_variant(torch_runner())


def test_hidden_states_come_from_the_c_layers_row_by_row(isa):
    """hidden_layers (what the draft head reads) from the same C call: layer 0's input is the
    embedding, and a verified token's states are those of decoding it alone."""
    runner = c_runner()
    layers = len(runner.layers)
    runner.hidden_layers = (0, 1, layers)
    ids, new = tokens(30), tokens(6, seed=3)
    runner.forward(ids, 1)
    together = runner.forward(new, 6), runner.hidden
    assert together[1].shape == (6, 3, runner.model.config.hidden_size)
    assert torch.equal(together[1][:, 0], runner.embedding(new))
    runner.crop(len(ids))
    alone = [(runner.forward(new[j : j + 1], 1), runner.hidden) for j in range(6)]
    assert torch.equal(together[0], torch.cat([logits for logits, _ in alone]))
    assert torch.equal(together[1], torch.cat([hidden for _, hidden in alone]))


@pytest.mark.skipif(len(kernel_isas()) < 2, reason="this CPU runs one build of the kernels")
@pytest.mark.parametrize(
    "config", [dict(dtype=torch.bfloat16), dict(dtype=torch.float32), dict(attention_bias=True, kv_heads=1)],
    ids=["bf16", "fp32", "biases-one-kv-head"],
)  # fmt: skip
def test_every_build_writes_the_layers_bits_of_the_fastest(config):
    """The C layers of the AVX2 and portable builds (the layer source compiled for that
    instruction set, calling that build's product) against AVX512-VNNI's: prefills, chains, a tree
    and one-token decoding in batches of sequences, logits and hidden states, bit for bit (the
    norm, rope, silu and attention are the same float operations in the same order on each)."""
    fastest, *others = kernel_isas()
    with forced_kernel_isa(fastest):
        expected = every_kind_of_forward(c_runner(Int8Recipe(), **config), 2)
    for isa in others:
        with forced_kernel_isa(isa):
            runner = c_runner(Int8Recipe(), **config)
            assert runner._int8_layers._kernel.isa == isa
            assert all(same_bits(a, b) for a, b in zip(every_kind_of_forward(runner, 2), expected, strict=True)), isa
