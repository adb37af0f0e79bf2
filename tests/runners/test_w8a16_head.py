"""w8a16 (projection.W8A16Projection; Int8Recipe.w8a16): int8 weights, every activation row on its
own scale in ~15-bit integers, exact integer sums (the C kernel's two byte sums a weight quad, or
torch's float64 products of integers) and w8a8's epilogue. The C kernel gives the torch
reference's bits; a verified token's logits are those of decoding it alone (negative control: one
activation scale for the batch); speculation equals target-only decoding; the response cache's
fingerprint names the head's kind; without the kernel the same bits come from torch. The kernel
tests run on every build of the kernels this CPU runs (the `isa` fixture: AVX512-VNNI, AVX2,
portable C), and the builds are compared bit for bit.
"""

import logging
from collections.abc import Iterator

import pytest
import torch

import helpers
from helpers import assert_drafted_and_accepted, awkward_rows, head64_llama, same_bits, same_bits_on_one_thread_and_two
from helpers.bits import forced_kernel_isa, kernel_isas
from specdecode import SpeculativeEngine
from specdecode.cache.response_cache import runner_variant
from specdecode.drafters import PromptLookupDrafter
from specdecode.kernels import int8_kernel
from specdecode.runners import projection
from specdecode.runners.fast_llama import FastLlamaRunner, Int8Recipe
from specdecode.runners.projection import W8A16Projection, w8a16_projection

pytestmark = pytest.mark.skipif(not projection.int8_supported(), reason="no oneDNN int8 products in this torch")

HEAD_W8A16 = Int8Recipe(keep_float=(), w8a16=("head",))  # the layers w8a8 and smoothed, the head w8a16
needs_kernel = pytest.mark.skipif(projection.own_kernel() is None, reason="no own w8a8 kernel or no gcc here")


@pytest.fixture(params=kernel_isas())
def isa(request) -> Iterator[str]:
    """Each build of the int8 kernels this CPU runs, forced for the test (helpers.bits)."""
    with forced_kernel_isa(request.param):
        yield request.param


def tokens(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))


def wide_rows(n: int, inputs: int, dtype: torch.dtype, seed: int) -> torch.Tensor:  # [n, inputs]
    """awkward_rows with w8a16's largest code for this many inputs."""
    return awkward_rows(n, inputs, dtype, seed, largest=float(int8_kernel.wide_activation_limit(inputs)))


def reference(product: W8A16Projection, x: torch.Tensor) -> torch.Tensor:
    """The torch path's arithmetic: the quantization, exact sums, w8a8's epilogue."""
    codes, row_scales = projection.wide_quantize_rows_torch(x)
    return projection.epilogue_torch(product.reference_sums(codes), row_scales, product.bias, x.dtype)


def test_the_activation_limit_keeps_int32_sums_exact():
    for k in (4, 576, 1536, 2**15, 2**16 - 4):
        limit = int8_kernel.wide_activation_limit(k)
        assert 1 <= limit <= 16383 and limit * 127 * k < 2**31
    assert int8_kernel.wide_activation_limit(576) == 16383  # the default model's hidden size


def test_the_torch_path_is_exact_and_close_to_the_float_product():
    weight = torch.randn(300, 576, generator=torch.Generator().manual_seed(0))
    product = w8a16_projection(weight, None)
    x = torch.randn(8, 576, generator=torch.Generator().manual_seed(1))
    codes, row_scales = projection.wide_quantize_rows_torch(x)
    exact = (codes.long() @ product.codes().long().T).float() * product.scales  # int64: exact
    assert torch.equal(product.reference_sums(codes), exact)
    dequantized = (codes.float() * row_scales) @ (product.codes().float() * product.scales[:, None]).T
    full = x @ weight.T
    assert (product(x) - full).norm() / full.norm() < 0.02  # the weights' int8 error
    assert (product(x) - dequantized).norm() / full.norm() < 1e-5


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_c_kernel_gives_the_torch_reference_s_bits(dtype, isa):
    """Shapes with a last group of 40 columns and more inputs than the limit's 16383 allows at
    full range; 1 to 40 rows (tiles of 3 rows, threads by columns); zeros, huge and denormal
    rows; biases; all-positive rows and weights, whose sums pass 2^24 (the float conversion rounds)."""
    kernel = int8_kernel.load()
    generator = torch.Generator().manual_seed(5)
    for out, inputs in ((1000, 576), (576, 576), (64, 1536), (40, 5000), (130, 64)):
        weight = torch.randn(out, inputs, generator=generator)
        for bias in (None, torch.randn(out, generator=generator).to(dtype)):
            product = w8a16_projection(weight, bias)
            assert product.compensation is not None  # the packed layout: the C kernel runs
            for n in (1, 2, 3, 4, 5, 7, 8, 16, 17, 40):
                x = wide_rows(n, inputs, dtype, seed=n + out)
                expected = reference(product, x)
                assert same_bits(product(x), expected), (out, inputs, n)
                codes, row_scales = kernel.wide_quantize_rows(x)  # the C quantization alone
                torch_codes, torch_scales = projection.wide_quantize_rows_torch(x)
                assert torch.equal(codes, torch_codes) and same_bits(row_scales, torch_scales), (out, inputs, n)
                two_calls = kernel.wide_product(codes, row_scales, product.weight, product.compensation,
                                                product.scales, bias, dtype)  # fmt: skip
                assert same_bits(two_calls, expected), (out, inputs, n)
    weight = torch.rand(64, 1536, generator=generator) * 0.1 + 1.0
    positive = (torch.rand(3, 1536, generator=generator) * 0.1 + 1.0).to(dtype)
    product = w8a16_projection(weight, None)
    assert (product.reference_sums(projection.wide_quantize_rows_torch(positive)[0]) / product.scales).min() > 2**24
    assert same_bits(product(positive), reference(product, positive))


@needs_kernel
def test_one_thread_and_two_give_the_same_bits(isa):
    product = w8a16_projection(torch.randn(3072, 576, generator=torch.Generator().manual_seed(7)), None)
    assert same_bits_on_one_thread_and_two(product, wide_rows(20, 576, torch.bfloat16, seed=8))


def runner(recipe: Int8Recipe = HEAD_W8A16, dtype=torch.bfloat16, **config) -> FastLlamaRunner:
    r = FastLlamaRunner(head64_llama(0, dtype, **config), "w8a8", recipe)
    assert isinstance(r.lm_head, W8A16Projection) and r.verifies_trees
    return r


def verified_differs_from_alone(r: FastLlamaRunner, n: int) -> int:
    return helpers.verified_differs_from_alone(r, n, starts=range(10, 170, 40), length=200)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("n", [1, 8, 16])
def test_a_verified_token_gets_the_logits_of_decoding_it_alone(n, dtype, isa):
    assert verified_differs_from_alone(runner(dtype=dtype), n) == 0


def per_batch_scale(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The wrong quantization: one scale for every row of the product."""
    limit = int8_kernel.wide_activation_limit(x.shape[1])
    x = x.float()
    scale = x.abs().amax().clamp_min(1e-30) / limit
    return torch.round(x / scale).to(torch.int32), scale.expand(x.shape[0], 1).contiguous()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_one_activation_scale_for_the_batch_would_tie_a_token_to_the_others(monkeypatch, dtype, isa):
    """Negative control of the test above, in the head alone (the layers keep their C call)."""
    monkeypatch.setattr(projection, "wide_row_quantization", per_batch_scale)
    assert verified_differs_from_alone(runner(dtype=dtype), 8) > 0


def test_tree_nodes_get_the_logits_of_decoding_their_path_alone(isa):
    r = runner()
    ids = tokens(60)
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, -1, 6, 3, 8, 4, 5])
    nodes = tokens(len(parents), seed=2)
    r.forward(ids, 1)
    tree = r.forward(nodes, len(nodes), parents)
    for i in range(len(nodes)):
        path, node = [], i
        while node >= 0:
            path.insert(0, node)
            node = int(parents[node])
        r.crop(len(ids))
        alone = torch.cat([r.forward(nodes[j : j + 1], 1) for j in path])[-1:]
        assert torch.equal(tree[i : i + 1], alone), i


def test_speculation_equals_target_only_decoding_of_the_same_engine(isa):
    r = runner(tie_word_embeddings=True)
    engine = SpeculativeEngine(r, drafter=PromptLookupDrafter(), num_speculative_tokens=6)  # k pinned
    prompts = [[7, 8, 9, 10, 11, 7, 8, 9, 10, 11, 7, 8] * 3, list(range(40, 90)), [3, 1, 4, 1, 5, 9, 2, 6] * 4]
    target_only = [x.token_ids for x in engine.generate(prompts, max_new_tokens=60, speculative=False)]
    speculative = engine.generate(prompts, max_new_tokens=60)
    assert_drafted_and_accepted(speculative)
    assert [x.token_ids for x in speculative] == target_only
    batched = engine.generate(prompts, max_new_tokens=60, max_batch_size=3)
    assert_drafted_and_accepted(batched)
    assert [x.token_ids for x in batched] == target_only


def test_the_head_is_int8_and_close_to_the_float_head():
    """One int8 copy of the head and logits close to the bf16 head's, not equal."""
    model = head64_llama(0, torch.bfloat16, tie_word_embeddings=True)
    float_head = FastLlamaRunner(model, "w8a8", Int8Recipe(keep_float=("head",)))
    w8a16 = FastLlamaRunner(model, "w8a8", HEAD_W8A16)
    assert w8a16.lm_head.weight.dtype == torch.int8
    assert w8a16.lm_head.nbytes < 0.55 * float_head.lm_head.nbytes
    ids = tokens(30)
    a, b = float_head.forward(ids, 30), w8a16.forward(ids, 30)
    assert not torch.equal(a, b)
    assert (a - b).abs().max() < 0.05 * a.abs().max()


@pytest.mark.parametrize("kernel", [True, False], ids=["packed codes", "plain codes"])
def test_a_tied_embedding_is_read_from_the_head_s_codes_and_its_16_bit_copy_freed(kernel, monkeypatch):
    """Row t is code row t times scale t (close to the embedding, not equal: 8 bits); a head with
    a float copy keeps the embedding matrix; freed, the model's embedding leaves the same logits."""
    if kernel and projection.own_kernel() is None:
        pytest.skip("no own w8a8 kernel or no gcc here")
    if not kernel:
        monkeypatch.setattr(projection, "own_kernel", lambda: None)
    model = head64_llama(0, torch.bfloat16, tie_word_embeddings=True)
    embedding = model.get_input_embeddings().weight.detach().clone()
    r = FastLlamaRunner(model, "w8a8", HEAD_W8A16)
    assert r.embedding_kind == "int8 codes of the output head"
    assert (r.lm_head.compensation is not None) == kernel
    ids = torch.tensor([0, 5, 17, 16, 255, 3, 3])
    rows = r.embedding(ids)
    expected = (r.lm_head.codes()[ids].float() * r.lm_head.scales[ids, None]).to(torch.bfloat16)
    assert same_bits(rows, expected)
    assert not torch.equal(rows, embedding[ids]) and (rows - embedding[ids]).abs().max() < 0.02 * embedding.abs().max()
    untied = FastLlamaRunner(head64_llama(0, torch.bfloat16), "w8a8", HEAD_W8A16)
    assert untied.embedding_kind == "the embedding matrix"
    float_head = FastLlamaRunner(model, "w8a8", Int8Recipe(keep_float=("head",)))
    assert float_head.embedding_kind == "the embedding matrix"
    prompt = tokens(30)
    before = r.forward(prompt, 30)
    r.release_model_weights()
    assert model.get_input_embeddings().weight.device.type == "meta"
    assert model.get_output_embeddings().weight.device.type == "meta"
    r.reset()
    assert same_bits(r.forward(prompt, 30), before)
    assert runner_variant(r) != runner_variant(untied)


def test_recipes_name_w8a16_products_and_the_fingerprint_names_the_head():
    assert HEAD_W8A16.mode("head") == "w8a16" and HEAD_W8A16.mode("down") == "w8a8"
    assert Int8Recipe(keep_float=("head",)).mode("head") == "float"
    with pytest.raises(ValueError, match="both kept in float and w8a16"):
        Int8Recipe(keep_float=("head",), w8a16=("head",))
    with pytest.raises(ValueError, match="unknown products"):
        Int8Recipe(keep_float=(), w8a16=("lm",))
    model = head64_llama(0, torch.bfloat16)
    float_head = FastLlamaRunner(model, "w8a8", Int8Recipe(keep_float=("head",)))
    int8_head = FastLlamaRunner(model, "w8a8", Int8Recipe(keep_float=()))
    w8a16 = FastLlamaRunner(model, "w8a8", HEAD_W8A16)
    variants = [runner_variant(r) for r in (float_head, int8_head, w8a16)]
    assert len({repr(v) for v in variants}) == 3


def test_without_the_kernel_the_head_runs_torch_s_operations_with_the_same_bits(monkeypatch, caplog):
    ids, verified = tokens(40), tokens(8, seed=5)
    with_kernel = runner()
    with_kernel._int8_layers = None  # the layers on torch's path on both sides (their C call is its own)
    expected = [with_kernel.forward(ids, 3), with_kernel.forward(verified, 8)]

    def no_compiler(key: str, isa: str):
        raise RuntimeError("no gcc on PATH")

    monkeypatch.setattr(int8_kernel, "_loaded", {})
    monkeypatch.setattr(int8_kernel, "_ready", [])
    monkeypatch.setattr(int8_kernel, "_build", no_compiler)
    with caplog.at_level(logging.WARNING, logger="specdecode.kernels.int8_kernel"):
        without = runner()
    assert without.lm_head.compensation is None  # plain codes: the torch path
    assert verified_differs_from_alone(without, 8) == 0
    if not projection.has_vnni():  # the layers' oneDNN products take 7-bit weights here: other bits, told apart
        assert runner_variant(without) != runner_variant(with_kernel)
        return
    without.reset()  # decoding from an empty cache, as expected was (the count above left its sequence there)
    assert same_bits(without.forward(ids, 3), expected[0]) and same_bits(without.forward(verified, 8), expected[1])
    assert runner_variant(without) == runner_variant(with_kernel)


def test_the_default_head_is_w8a16_where_the_kernel_runs_else_the_model_s_dtype(monkeypatch):
    from specdecode.loading import precision_of

    model = head64_llama(0, torch.bfloat16)
    default = FastLlamaRunner(model, "w8a8")
    if projection.own_kernel() is not None:
        assert isinstance(default.lm_head, W8A16Projection) and default.lm_head.compensation is not None
        assert "16-bit activations in head" in precision_of(model, default)
    monkeypatch.setattr(projection, "own_kernel", lambda: None)  # a CPU without AVX512-VNNI
    assert Int8Recipe().mode("head") == "float" and Int8Recipe().mode("down") == "w8a8"
    elsewhere = FastLlamaRunner(model, "w8a8")
    assert not isinstance(elsewhere.lm_head, W8A16Projection | projection.Int8Projection)
    assert "16-bit" not in precision_of(model, elsewhere)


several_builds = pytest.mark.skipif(
    projection.own_kernel() is None or len(kernel_isas()) < 2, reason="this CPU runs one build of the kernels"
)


@several_builds
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_build_writes_the_head_s_bits_of_the_fastest(dtype):
    """w8a16 products of every build against the fastest's (AMX's tiles from 4 rows on): the quantization's
    bytes and scales, the product in one call and after it; awkward rows (zeros, denormal and huge
    scales, exact halves at the largest code, a NaN, an infinity), 1 to 40 rows, last groups of 1 to
    63 columns, inputs that are no multiple of 8 or 16, and more inputs than the full 16383 allows."""
    builds = [int8_kernel.load(isa) for isa in kernel_isas()]
    generator = torch.Generator().manual_seed(5)
    for out, inputs in ((1000, 576), (64, 1536), (40, 5000), (7, 20), (65, 68)):
        weight = torch.randn(out, inputs, generator=generator)
        for bias in (None, torch.randn(out, generator=generator).to(dtype)):
            with forced_kernel_isa(kernel_isas()[0]):
                product = w8a16_projection(weight, bias)
            packed = (product.weight, product.compensation, product.scales)
            for n in (1, 2, 3, 4, 5, 7, 8, 16, 17, 40):
                x = wide_rows(n, inputs, dtype, seed=n + out)
                if n > 4:
                    x[3, -1], x[4, 0] = float("nan"), float("inf")
                codes, row_scales = builds[0].wide_quantize_rows(x)
                expected = builds[0].wide_quantized_product(x, *packed, bias)
                for build in builds[1:]:
                    theirs = build.wide_quantize_rows(x)
                    assert torch.equal(theirs[0], codes) and same_bits(theirs[1], row_scales), (build.isa, out, n)
                    assert same_bits(build.wide_quantized_product(x, *packed, bias), expected), (build.isa, out, n)
                    two_calls = build.wide_product(codes, row_scales, *packed, bias, dtype)
                    assert same_bits(two_calls, expected), (build.isa, out, inputs, n)


@several_builds
def test_every_build_writes_the_runner_s_logits_of_the_fastest():
    """A runner with the w8a16 head (its layers the C decoder layers), each build forced: logits of
    a prefill, a verification chain and a tree, bit for bit."""
    parents = torch.tensor([-1, 0, 0, 1, 1, 2])

    def logits(isa: str) -> list[torch.Tensor]:
        with forced_kernel_isa(isa):
            r = runner(tie_word_embeddings=True)
            out = [r.forward(tokens(40), 3), r.forward(tokens(8, seed=2), 8)]
            return out + [r.forward(tokens(6, seed=3), 6, parents)]

    expected = logits(kernel_isas()[0])
    for isa in kernel_isas()[1:]:
        assert all(same_bits(a, b) for a, b in zip(logits(isa), expected, strict=True)), isa
