"""The w8a8 fast path (int8 weights, per-row int8 activations, oneDNN's int8 products): a row's
logits are bitwise the same alone and among others, so speculation over the 8-bit target is
exact relative to that 8-bit model's own decoding.

No sampling G-test here: a sampled token is a function of the target's logits and the random
stream, and the tests below prove those logits bitwise equal to one-token decoding's in every
verification shape (chains, trees, ragged batches); the accept rule's law is tested on exact
logits elsewhere (tests/decoder/test_sampling_law.py, tests/decoder/test_trees.py). Equal bits leave no
distribution to test.

The tests of the kernels run on every build of them this CPU runs (the `isa` fixture forces each:
AVX512-VNNI, AVX2, portable C), and the builds are compared with each other bit for bit.
"""

import logging
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch

import helpers
from helpers import (
    BITS,
    assert_drafted_and_accepted,
    awkward_rows,
    head64_llama,
    same_bits,
    same_bits_on_one_thread_and_two,
    tiny_tokenizer,
)
from helpers.bits import forced_kernel_isa, kernel_isas
from specdecode import InvalidArgumentError, SpeculativeEngine, cpu, precision
from specdecode.drafters import PromptLookupDrafter
from specdecode.kernels import int8_kernel, native
from specdecode.runners import projection, smoothing
from specdecode.runners.fast_llama import FastLlamaRunner, Int8Recipe
from specdecode.runners.projection import Int8Projection, int8_projection, int8_supported

pytestmark = pytest.mark.skipif(not int8_supported(), reason="no oneDNN int8 products in this torch")

EVERY_PRODUCT = Int8Recipe(keep_float=(), smoothing=0.0)  # the head too, and no smoothing
RECIPES = [pytest.param(EVERY_PRODUCT, id="all-int8"), pytest.param(Int8Recipe(), id="default-smoothed")]


@pytest.fixture(params=kernel_isas())
def isa(request) -> Iterator[str]:
    """Each build of the int8 kernels this CPU runs, forced for the test (helpers.bits)."""
    with forced_kernel_isa(request.param):
        yield request.param


def int8_runner(recipe: Int8Recipe = EVERY_PRODUCT, seed: int = 0, dtype=torch.bfloat16) -> FastLlamaRunner:
    runner = FastLlamaRunner(head64_llama(seed, dtype), "w8a8", recipe)
    assert runner.verifies_trees  # the tree attention kernel runs: attention is per row too
    return runner


def tokens(n: int, seed: int = 1) -> torch.Tensor:  # [n]
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))


def verified_differs_from_alone(runner: FastLlamaRunner, n: int) -> int:
    """Of 8 verification forwards of n tokens, how many differ bitwise from decoding them alone."""
    return helpers.verified_differs_from_alone(runner, n, starts=range(10, 170, 20), length=200)


def per_batch_scale(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The wrong quantization: one activation scale for every row of a product."""
    x = x.float()
    scale = x.abs().amax().clamp_min(1e-30) / 127.0
    codes = torch.round(x / scale).add_(projection.ACTIVATION_ZERO_POINT).to(torch.uint8)
    return codes, scale.expand(x.shape[0], 1).contiguous()


def test_int8_products_give_a_row_the_same_bits_alone_and_among_others(isa):
    """Product level, past the 32 rows below which oneDNN's float kernels are row-independent."""
    weight = torch.randn(300, 1536, generator=torch.Generator().manual_seed(0))
    product = int8_projection(weight, None)
    x = torch.randn(100, 1536, generator=torch.Generator().manual_seed(1)).bfloat16()
    together = product(x)
    for rows in (1, 2, 5, 16, 33, 100):
        assert torch.equal(product(x[:rows]), together[:rows])
    assert all(torch.equal(product(x[i : i + 1]), together[i : i + 1]) for i in range(100))
    assert not torch.equal(product(x[:1] * 2), together[:1])  # the rows do reach the result


def test_int8_products_are_close_to_the_float_product():
    weight = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(1))
    exact = x @ weight.T
    relative = (int8_projection(weight, None)(x) - exact).norm() / exact.norm()
    assert relative < 0.02


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("n", [1, 2, 5, 8, 16])
def test_a_verified_token_gets_the_logits_of_decoding_it_alone(recipe, n, isa):
    assert verified_differs_from_alone(int8_runner(recipe), n) == 0


def test_one_activation_scale_for_the_whole_batch_would_tie_a_token_to_the_others(monkeypatch, isa):
    """Negative control of the test above: quantized on the batch's scale, rows differ."""
    monkeypatch.setattr(projection, "row_quantization", per_batch_scale)
    assert verified_differs_from_alone(int8_runner(), 8) > 0


def test_tree_nodes_get_the_logits_of_decoding_their_path_alone(isa):
    runner = int8_runner()
    ids = tokens(60)
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, -1, 6, 3, 8, 4, 5])  # two roots, branches, depth 5
    nodes = tokens(len(parents), seed=2)
    runner.forward(ids, 1)
    tree = runner.forward(nodes, len(nodes), parents)
    for i in range(len(nodes)):
        path, node = [], i
        while node >= 0:
            path.insert(0, node)
            node = int(parents[node])
        runner.crop(len(ids))
        alone = runner.forward(nodes[path], len(path))[-1:]  # the path as a verified chain
        assert torch.equal(tree[i : i + 1], alone), i


def test_ragged_batches_give_each_sequence_its_logits_alone(isa):
    runner = int8_runner()
    generator = torch.Generator().manual_seed(2)
    sequences = [torch.randint(0, 256, (n,), generator=generator) for n in (40, 12, 27, 9)]
    new = [5, 1, 16, 3]

    def run(group: list[int]) -> list[torch.Tensor]:
        caches = [runner.new_cache() for _ in group]
        ids = [sequences[i] for i in group]
        prefills = runner.forward_batch(caches, [s[: -new[i]] for s, i in zip(ids, group)], [1] * len(group))
        verified = runner.forward_batch(caches, [s[-new[i] :] for s, i in zip(ids, group)], [new[i] for i in group])
        return [torch.cat(pair) for pair in zip(prefills, verified)]

    together = run([0, 1, 2, 3])
    for i in range(4):
        assert torch.equal(run([i])[0], together[i])


@pytest.mark.parametrize("recipe", RECIPES)
def test_speculation_over_the_8_bit_target_equals_its_own_target_only_decoding(recipe, isa):
    engine = SpeculativeEngine(int8_runner(recipe), drafter=PromptLookupDrafter(), num_speculative_tokens=6)  # k pinned
    prompts = [[7, 8, 9, 10, 11, 7, 8, 9, 10, 11, 7, 8] * 3, list(range(40, 90)), [3, 1, 4, 1, 5, 9, 2, 6] * 4]
    target_only = [r.token_ids for r in engine.generate(prompts, max_new_tokens=60, speculative=False)]
    speculative = engine.generate(prompts, max_new_tokens=60)
    assert_drafted_and_accepted(speculative)
    assert [r.token_ids for r in speculative] == target_only
    batched = engine.generate(prompts, max_new_tokens=60, max_batch_size=3)
    assert_drafted_and_accepted(batched)
    assert [r.token_ids for r in batched] == target_only


def test_the_8_bit_model_is_a_different_rounding_of_the_same_model():
    """Close to the bfloat16 logits, and not equal to them (the products do run in int8)."""
    model = head64_llama(0, torch.bfloat16)
    ids = tokens(30)
    full = FastLlamaRunner(model).forward(ids, 30)
    int8 = FastLlamaRunner(model, "w8a8", EVERY_PRODUCT).forward(ids, 30)
    assert not torch.equal(full, int8)
    assert (full.argmax(-1) == int8.argmax(-1)).float().mean() > 0.8
    assert (full - int8).abs().max() < 0.1 * full.abs().max()


def test_one_copy_of_the_weights_in_int8():
    model = head64_llama(0, torch.bfloat16)
    bf16, int8 = FastLlamaRunner(model), FastLlamaRunner(model, "w8a8", EVERY_PRODUCT)

    def products(r: FastLlamaRunner) -> list:
        return [r.lm_head] + [p for layer in r.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)]

    assert all(isinstance(p, Int8Projection) for p in products(int8))
    # one byte a weight, against two; and 12 bytes of scale and zero point per output channel
    assert sum(p.nbytes for p in products(int8)) < 0.55 * sum(p.nbytes for p in products(bf16))
    int8.release_model_weights()  # the float weights the products replaced are freed
    assert all(m.weight.device.type == "meta" for m in int8._copied_modules())
    assert int8.forward(tokens(5), 5).isfinite().all()


def test_recipes_name_products():
    # the default head: 16-bit activations where the own VNNI kernel runs, else the model's dtype
    assert Int8Recipe().mode("head") == ("w8a16" if projection.own_kernel() is not None else "float")
    assert not Int8Recipe(keep_float=("head",)).quantizes("head") and Int8Recipe(keep_float=()).mode("head") == "w8a8"
    assert Int8Recipe().quantizes("down") and not Int8Recipe(keep_float=("down",)).quantizes("down")
    with pytest.raises(ValueError, match="unknown products"):
        Int8Recipe(keep_float=("mlp",))
    with pytest.raises(ValueError, match="unknown quantization"):
        FastLlamaRunner(head64_llama(0), "int4")


WITHOUT_VNNI = """
import torch
from specdecode.runners import projection
projection.own_kernel = lambda: None  # oneDNN's products, as where the own kernel did not build
assert projection.weight_limit() == {limit}
weight = torch.randn(64, 1536, generator=torch.Generator().manual_seed(0))
x = torch.randn(8, 1536, generator=torch.Generator().manual_seed(1))
product = projection.int8_projection(weight, None)
codes, row_scales = projection.quantize_rows(x)
scales = weight.abs().amax(dim=1) / {limit}
weight_codes = torch.round(weight / scales[:, None]).clamp(-{limit}, {limit})
sums = (codes.double() - 128) @ weight_codes.double().T  # the exact integer sums
print(torch.equal(product(x), (sums.float() * product.scales) * row_scales))
"""


@pytest.mark.parametrize("limit", [63, 127])
def test_without_vnni_seven_bit_weights_keep_the_integer_sums_exact(limit, monkeypatch):
    """oneDNN capped below VNNI (as on CPUs without it, where the own kernel did not build) sums
    u8 x s8 pairs in 16 saturating bits: 7-bit weights (what weight_limit() picks there) give the exact sums; 8-bit ones, the
    negative control, do not."""
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX2")
    code = WITHOUT_VNNI.format(limit=limit)
    if limit == 127:  # force 8-bit codes where the cap would pick 7
        code = code.replace("assert projection.weight_limit() == 127", "projection.weight_limit = lambda: 127")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ("True" if limit == 63 else "False")


def test_smoothing_keeps_the_float_model_and_the_rows_exact():
    """SmoothQuant's factors folded into the norms and the up projection leave the float
    product as it was: smoothed int8 logits stay as close to bfloat16's as unsmoothed ones do,
    and a verified token still gets its one-token bits."""
    model = head64_llama(0, torch.bfloat16)
    recipe = Int8Recipe(keep_float=(), smoothing=0.5, calibration=tuple(tokens(64, seed=3).tolist()))
    smoothed = FastLlamaRunner(model, "w8a8", recipe)
    ids = tokens(30)
    full = FastLlamaRunner(model).forward(ids, 30)
    assert (full - smoothed.forward(ids, 30)).abs().max() < 0.1 * full.abs().max()
    assert not torch.equal(smoothed.layers[0].attn_norm, model.model.layers[0].input_layernorm.weight)
    assert verified_differs_from_alone(smoothed, 5) == 0
    with pytest.raises(ValueError, match="alpha"):
        Int8Recipe(smoothing=1.5)
    default = FastLlamaRunner(model, "w8a8")  # smoothed, calibrated on random ids of a fixed seed
    again = FastLlamaRunner(model, "w8a8")
    assert torch.equal(default.forward(ids, 30), again.forward(ids, 30))  # the same model at every load


def test_the_head_is_calibrated_on_every_position():
    """The head's smoothing divisors come from its input at every calibration position (the
    final norm's output), not from the last position alone, the only one it makes logits for."""
    model = head64_llama(0, torch.float32)
    ids = tokens(64, seed=3)
    recorded = smoothing.input_maxima(model, ids)[-1]["head"]  # [hidden]
    with torch.no_grad():
        normed = model.model(ids[None], use_cache=False).last_hidden_state[0]  # [n, hidden], after the final norm
    assert torch.equal(recorded, normed.abs().amax(dim=0))
    assert not torch.equal(recorded, normed[-1].abs())  # the last position alone gives others


def test_from_pretrained_takes_w8a8_by_name_and_says_so(tmp_path):
    """`quantization="w8a8"` (`--quantization w8a8`) loads the float model and quantizes it on the
    fast runner; the results' stats name the precision; the transformers runner refuses it."""
    head64_llama(0, torch.bfloat16).save_pretrained(tmp_path)
    tiny_tokenizer(256).save_pretrained(tmp_path)
    engine = SpeculativeEngine.from_pretrained(
        str(tmp_path), quantization="w8a8", dtype="bfloat16", drafter="prompt-lookup", num_speculative_tokens=6
    )
    assert engine.target_runner.quantization is precision.W8A8
    prompt = [[7, 8, 9, 10, 11, 7, 8, 9, 10, 11, 7, 8] * 3]
    speculative = engine.generate(prompt, max_new_tokens=40)
    assert_drafted_and_accepted(speculative)
    assert speculative[0].token_ids == engine.generate(prompt, max_new_tokens=40, speculative=False)[0].token_ids
    assert speculative[0].stats.target_precision.startswith("w8a8 (int8 weights and activations")
    with pytest.raises(InvalidArgumentError, match="leave the runner at auto") as refused:
        SpeculativeEngine.from_pretrained(str(tmp_path), quantization="w8a8", runner="transformers")
    assert refused.value.param == "quantization"


def test_folded_weights_keep_no_autograd_graph():
    """Smoothing divides norm weights (parameters) by factors: a graph behind the results would
    hold float copies of every layer's weights for as long as the runner lives."""
    runner = int8_runner(Int8Recipe())
    kept = [runner.final_norm] + [w for layer in runner.layers for w in (layer.attn_norm, layer.mlp_norm)]
    assert all(w.grad_fn is None for w in kept)


# ---- the C kernels (int8_kernel.py): the torch operations' bits, one call instead of many ----

kernel = int8_kernel.load()
needs_own_product = pytest.mark.skipif(projection.own_kernel() is None, reason="no AVX512-VNNI: oneDNN's products run")


@pytest.fixture(scope="module", params=kernel_isas())
def c_kernel(request) -> int8_kernel.Int8Kernel:
    """Each build of the kernel this CPU runs: AMX's, AVX512-VNNI's, AVX2's and the portable C (which
    CPUs without AVX2 run), each loaded as SPECDECODE_KERNEL_ISA would choose it."""
    if kernel is None:
        pytest.skip("no C compiler: the products run torch's operations")
    built = int8_kernel.load(request.param)
    assert built is not None and built.isa == request.param
    return built


@pytest.mark.skipif("amx" not in kernel_isas(), reason="this CPU has no AMX-INT8")
def test_the_amx_build_multiplies_on_tiles():
    """Where the AMX build runs (cpu.amx_tiles_granted), its library got the tiles too, so its
    products of 4 rows or more are tile multiplies, and the comparisons of the builds' bits above
    and below compare the tiles' sums, not its vpdpbusd items again."""
    assert cpu.amx_tiles_granted() and int8_kernel.load("amx").tiles
    assert not int8_kernel.load("avx512-vnni").tiles


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_c_quantization_gives_the_torch_operations_bits(c_kernel, dtype):
    kernel = c_kernel
    for n in range(1, 41):
        for inputs in (576, 1536, 19, 1):
            x = awkward_rows(n, inputs, dtype, seed=n * 7 + inputs)
            codes, scales = kernel.quantize_rows(x)
            torch_codes, torch_scales = projection.quantize_rows_torch(x)
            assert torch.equal(codes, torch_codes) and same_bits(scales, torch_scales), (n, inputs)
    strided = awkward_rows(8, 1200, dtype, seed=3)[:, 100:676]  # rows apart by more than their length
    assert all(
        torch.equal(a, b) for a, b in zip(kernel.quantize_rows(strided), projection.quantize_rows_torch(strided))
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_c_epilogue_gives_the_torch_operations_bits(c_kernel, dtype):
    kernel = c_kernel
    generator = torch.Generator().manual_seed(4)
    for n in (1, 2, 5, 16, 33, 40):
        for out in (576, 960, 17, 5000):
            sums = torch.randn(n, out, generator=generator) * 10.0 ** torch.randint(
                -30, 30, (n, 1), generator=generator
            )
            _, row_scales = projection.quantize_rows_torch(awkward_rows(n, 64, dtype, seed=n))
            for bias in (None, torch.randn(out, generator=generator).to(dtype)):
                expected = projection.epilogue_torch(sums, row_scales, bias, dtype)
                assert same_bits(kernel.epilogue(sums, row_scales, bias, dtype), expected), (n, out)


def test_the_bit_comparison_catches_one_ulp():
    """Negative control of same_bits (helpers.bits), which every bit-for-bit comparison of the
    kernels uses: one element one ulp away is another result."""
    for dtype in BITS:
        y = torch.randn(4, 8, generator=torch.Generator().manual_seed(6)).to(dtype)
        moved = y.clone()
        moved.view(BITS[dtype])[2, 5] += 1  # the next representable value
        assert same_bits(y, y.clone()) and not same_bits(y, moved)
        assert 0 < (moved - y).abs().max() <= y[2, 5].abs() * 2**-7  # one ulp: close, not equal
    assert not same_bits(torch.zeros(3), -torch.zeros(3))  # which torch.equal would take


def onednn_twin(product: Int8Projection, weight: torch.Tensor) -> Int8Projection:  # weight [out, in]
    """The same codes and scales, prepacked for oneDNN's kernel."""
    limit = projection.weight_limit()
    codes = torch.round(weight / product.scales[:, None]).clamp_(-limit, limit).to(torch.int8)
    packed = torch.ops.onednn.qlinear_prepack(codes, [1, weight.shape[1]])
    zero_points = torch.zeros(weight.shape[0], dtype=torch.int64)
    return Int8Projection(packed, product.scales, zero_points, product.bias, product.shape)


@needs_own_product
@pytest.mark.skipif(not projection.has_vnni(), reason="without VNNI oneDNN's products saturate 8-bit weights' sums")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_own_int8_kernel_gives_onednn_s_bits(dtype, isa):
    """Products of the model's shapes (and a last group of 40 columns), 1 to 40 rows, in one call
    and after a separate quantization; the all-positive case makes sums beyond 2^24, where the
    int32 to float32 conversion rounds."""
    generator = torch.Generator().manual_seed(5)
    for out, inputs in ((576, 576), (192, 576), (1536, 576), (576, 1536), (1000, 64)):
        weight = torch.randn(out, inputs, generator=generator)
        for bias in (None, torch.randn(out, generator=generator).to(dtype)):
            own = int8_projection(weight, bias)
            assert own.compensation is not None  # the own layout
            onednn = onednn_twin(own, weight)
            for n in (1, 2, 5, 6, 7, 8, 13, 16, 32, 40):
                x = awkward_rows(n, inputs, dtype, seed=n + out)
                expected = onednn(x)
                assert same_bits(own(x), expected), (out, inputs, n)  # one call, quantizing too
                codes, row_scales = projection.quantize_rows(x)  # and after a quantization of its own
                two_calls = int8_kernel.load().product(
                    codes, row_scales, own.weight, own.compensation, own.scales, bias, dtype
                )
                assert same_bits(two_calls, expected), (out, inputs, n)
    weight = torch.rand(64, 1536, generator=generator) * 0.1 + 1.0  # codes 116 .. 127
    positive = (torch.rand(3, 1536, generator=generator) * 0.1 + 1.0).to(dtype)
    own = int8_projection(weight, None)
    integer_sums = own.sums(projection.quantize_rows(positive)[0]) / own.scales  # [3, 64], about
    assert integer_sums.abs().min() > 2**24
    assert same_bits(own(positive), onednn_twin(own, weight)(positive))


@needs_own_product
def test_the_own_int8_kernel_gives_the_same_bits_on_one_thread_and_on_two(isa):
    """Threads split the product by output columns and the quantization by rows: no sum is split."""
    product = int8_projection(torch.randn(3072, 576, generator=torch.Generator().manual_seed(7)), None)
    assert same_bits_on_one_thread_and_two(product, awkward_rows(20, 576, torch.bfloat16, seed=8))


@pytest.mark.skipif(int8_kernel.load() is None, reason="no gcc: the C kernel did not build")
def test_every_vectorized_build_runs_the_own_product_with_eight_bit_weights(monkeypatch):
    """A CPU without VNNI (oneDNN capped below it, as on AVX2 CPUs) takes the own kernel's AVX2
    build, whose int32 sums keep 8-bit weights exact; the portable build only where forced, else
    oneDNN's product with 7-bit weights."""
    kernel = int8_kernel.load()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    monkeypatch.setattr(kernel, "isa", "avx2")
    product = int8_projection(torch.randn(64, 64), None)
    assert projection.own_kernel() is kernel and product.compensation is not None and product.limit == 127
    monkeypatch.setattr(kernel, "isa", "portable")
    assert projection.own_kernel() is None
    product = int8_projection(torch.randn(64, 64), None)
    assert product.compensation is None and product.limit == 63  # oneDNN's layout
    monkeypatch.setenv(cpu.KERNEL_ISA_VARIABLE, "portable")
    assert projection.own_kernel() is kernel


def test_without_the_c_kernel_w8a8_runs_torch_s_operations_with_the_same_bits(monkeypatch, caplog):
    """A build that fails: one warning, oneDNN's products and torch's operations, and every
    logit as the kernels give it (so the response cache's fingerprint need not tell them
    apart: runner_variant is the same)."""
    from specdecode.cache.response_cache import runner_variant

    ids, verified = tokens(40), tokens(8, seed=5)
    with_kernels = int8_runner()
    # the layers on torch operations on both sides: the C layers (int8_layer.py, needing the
    # own product) are their own arithmetic, fingerprinted apart (tests/kernels/test_int8_layer.py)
    with_kernels._int8_layers = None
    expected = [with_kernels.forward(ids, 3), with_kernels.forward(verified, 8)]

    def no_compiler(key: str, isa: str):
        raise RuntimeError("no gcc on PATH")

    monkeypatch.setattr(int8_kernel, "_loaded", {})
    monkeypatch.setattr(int8_kernel, "_ready", [])
    monkeypatch.setattr(int8_kernel, "_build", no_compiler)
    with caplog.at_level(logging.WARNING, logger="specdecode.kernels.int8_kernel"):
        without = int8_runner()
    assert caplog.text.count("w8a8 kernel unavailable") == 1
    assert all(p.compensation is None for layer in without.layers for p in (layer.qkv, layer.o, layer.gate_up))
    if not projection.has_vnni():  # oneDNN's products take 7-bit weights here: other bits, fingerprinted apart
        assert runner_variant(without) != runner_variant(with_kernels)
        return
    assert same_bits(without.forward(ids, 3), expected[0]) and same_bits(without.forward(verified, 8), expected[1])
    assert runner_variant(without) == runner_variant(with_kernels)


# ---- the builds (cpu.KERNEL_ISAS): chosen from the CPU's flags, and the same bits on each ----

several_builds = pytest.mark.skipif(
    kernel is None or len(kernel_isas()) < 2, reason="this CPU runs one build of the kernels, or none is built"
)


def with_nan_and_inf(x: torch.Tensor) -> torch.Tensor:  # [n, in]: a NaN and an infinity in two rows
    x = x.clone()
    if x.shape[0] > 4:
        x[3, -1] = float("nan")
        x[4, 0] = float("inf")
    return x


def packed_weight(out: int, inputs: int, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Random weight codes (every value of -127 .. 127) in the own layout, their compensation, scales."""
    codes = torch.randint(-127, 128, (out, inputs), generator=generator, dtype=torch.int8)
    compensation = codes.sum(dim=1, dtype=torch.int32) * projection.ACTIVATION_ZERO_POINT
    return int8_kernel.Int8Kernel.pack(codes), compensation, torch.rand(out, generator=generator) * 0.01


def differing_products(build: int8_kernel.Int8Kernel, reference: int8_kernel.Int8Kernel, dtype) -> list:
    """The products (shape, rows) whose bits differ between two builds: awkward rows (zeros,
    denormal and huge scales, exact halves, a NaN, an infinity), 1 to 40 rows (every remainder of
    each build's row tiles), last groups of 1 to 63 columns, inputs that are no multiple of 8 or 16
    (the vector sections' tails), with and without a bias; in one call and after a quantization
    (which must give the same codes and scales)."""
    generator, differ = torch.Generator().manual_seed(11), []
    for out, inputs in ((576, 576), (960, 1536), (1, 4), (7, 20), (65, 68), (130, 1540)):
        packed, compensation, scales = packed_weight(out, inputs, generator)
        for bias in (None, torch.randn(out, generator=generator).to(dtype)):
            for n in (1, 2, 3, 4, 5, 6, 7, 8, 13, 16, 17, 40):
                x = with_nan_and_inf(awkward_rows(n, inputs, dtype, seed=n + out))
                expected = reference.quantized_product(x, packed, compensation, scales, bias)
                codes, row_scales = reference.quantize_rows(x)
                theirs = build.quantize_rows(x)
                two_calls = build.product(codes, row_scales, packed, compensation, scales, bias, dtype)
                same = torch.equal(theirs[0], codes) and same_bits(theirs[1], row_scales)
                same = same and same_bits(two_calls, expected)
                if not (same and same_bits(build.quantized_product(x, packed, compensation, scales, bias), expected)):
                    differ.append((out, inputs, n, bias is not None))
    return differ


@several_builds
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_build_writes_the_bits_of_the_fastest(dtype):
    """Every build against the fastest this CPU runs (AMX's, whose products of 4 rows or more are
    tile multiplies, or AVX512-VNNI's)."""
    fastest, *others = kernel_isas()
    for isa in others:
        assert differing_products(int8_kernel.load(isa), int8_kernel.load(fastest), dtype) == [], isa
    # the all-positive case: integer sums past 2^24, where the int32 to float32 conversion rounds
    weight = torch.rand(64, 1536, generator=torch.Generator().manual_seed(12)) * 0.1 + 1.0  # codes 116 .. 127
    positive = (torch.rand(3, 1536, generator=torch.Generator().manual_seed(13)) * 0.1 + 1.0).to(dtype)
    with forced_kernel_isa(fastest):
        product = int8_projection(weight, None)
        expected = product(positive)
    assert (product.sums(projection.quantize_rows(positive)[0]) / product.scales).abs().min() > 2**24
    for isa in others:
        with forced_kernel_isa(isa):
            assert same_bits(product(positive), expected), isa


@several_builds
def test_a_build_with_fma_contraction_writes_other_bits(tmp_path):
    """Negative control of the test above: the AVX2 build compiled letting gcc fuse a multiply into
    an add (-ffp-contract=fast: the float32 epilogue's y * scale + bias in one rounding) is caught.
    Integer sums alone would not catch it: the float operations' order is the point."""
    flags = [f for f in native.flags("avx2") if f != "-ffp-contract=off"] + ["-ffp-contract=fast"]
    library = tmp_path / "w8a8-contracted.so"
    subprocess.run(["gcc", *flags, "-o", str(library), str(int8_kernel.SOURCE), "-lm"], check=True, timeout=300)
    contracted = int8_kernel.Int8Kernel(native.open_library(library, int8_kernel.ABI_VERSION))
    assert contracted.isa == "avx2"
    differ = differing_products(contracted, int8_kernel.load(kernel_isas()[0]), torch.float32)
    assert differ and all(with_bias for *_, with_bias in differ)  # the bias sum is what fused


@several_builds
@pytest.mark.parametrize("model", ["head64", "tiny"])
def test_greedy_output_is_the_same_with_every_build(model):
    """End to end: the engine's speculative greedy output over the 8-bit target (three prompts in
    one batch, default recipe) and a verification's logits (a tree; on tiny a chain), each build
    forced: the same tokens and bits. head64's layers run in the C decoder layers (of that build),
    tiny's (head size 8: no tree kernel) on torch operations around the C products. Control:
    another seed's model differs."""
    prompts = [[7, 8, 9, 10, 11, 7, 8, 9, 10, 11, 7, 8] * 3, list(range(40, 90)), [3, 1, 4, 1, 5, 9, 2, 6] * 4]
    parents = torch.tensor([-1, 0, 0, 1, 1, 2])

    def run(isa: str, seed: int = 0) -> tuple[list, torch.Tensor]:
        with forced_kernel_isa(isa):
            llama = head64_llama(seed) if model == "head64" else helpers.tiny_llama(seed, vocab_size=256)
            runner = FastLlamaRunner(llama, "w8a8")
            assert runner.layers[0].qkv.compensation is not None  # the products in the own layout
            if model == "head64":  # the C layers of the forced build ran
                assert runner.layer_kernel is not None and runner._int8_layers._kernel.isa == isa
            engine = SpeculativeEngine(runner, drafter=PromptLookupDrafter(), num_speculative_tokens=6)
            outputs = engine.generate(prompts, max_new_tokens=40, max_batch_size=3)
            runner.reset()
            runner.forward(tokens(30), 1)
            tree = parents if runner.verifies_trees else None
            return [r.token_ids for r in outputs], runner.forward(tokens(6, seed=2), 6, tree)

    fastest, *others = kernel_isas()
    expected = run(fastest)
    for isa in others:
        output, logits = run(isa)
        assert output == expected[0] and same_bits(logits, expected[1]), isa
    other_model = run(others[0], seed=1)
    assert other_model[0] != expected[0] and not same_bits(other_model[1], expected[1])


def test_the_build_is_chosen_from_the_cpu_flags_and_the_variable(monkeypatch, caplog):
    """AMX where the CPU has AMX-INT8 (and AVX512-VNNI) and the OS grants the tiles, else
    AVX512-VNNI where it has it, else
    AVX2 where it has x86-64-v3, else portable C; SPECDECODE_KERNEL_ISA forces a build this CPU
    runs, and a build it does not run (its code would die of SIGILL) is refused with a warning."""
    every = cpu.KERNEL_ISAS["amx"] | cpu.KERNEL_ISAS["avx2"]
    monkeypatch.delenv(cpu.KERNEL_ISA_VARIABLE, raising=False)
    monkeypatch.setattr(cpu, "cpu_flags", lambda: every)
    monkeypatch.setattr(cpu, "_request_tiles", lambda: True)
    assert cpu.runnable_kernel_isas() == ("amx", "avx512-vnni", "avx2", "portable") and cpu.kernel_isa() == "amx"
    monkeypatch.setattr(cpu, "_request_tiles", lambda: False)  # an OS that keeps the tiles to itself
    assert cpu.runnable_kernel_isas() == ("avx512-vnni", "avx2", "portable") and cpu.kernel_isa() == "avx512-vnni"
    monkeypatch.setattr(cpu, "_request_tiles", lambda: True)
    monkeypatch.setattr(cpu, "cpu_flags", lambda: every - {"amx_int8"})
    assert cpu.runnable_kernel_isas() == ("avx512-vnni", "avx2", "portable") and cpu.kernel_isa() == "avx512-vnni"
    monkeypatch.setenv(cpu.KERNEL_ISA_VARIABLE, "AVX2")
    assert cpu.kernel_isa() == "avx2"
    monkeypatch.setenv(cpu.KERNEL_ISA_VARIABLE, "portable")
    assert cpu.kernel_isa() == "portable"
    monkeypatch.setattr(cpu, "cpu_flags", lambda: cpu.KERNEL_ISAS["avx2"] | {"avx512f"})  # AVX-512 without VNNI
    monkeypatch.setenv(cpu.KERNEL_ISA_VARIABLE, "avx512-vnni")
    with caplog.at_level(logging.WARNING, logger="specdecode.cpu"):
        assert cpu.kernel_isa() == "avx2"
    assert "SPECDECODE_KERNEL_ISA=avx512-vnni ignored" in caplog.text
    with pytest.raises(ValueError, match="does not run the avx512-vnni build"):
        int8_kernel.load("avx512-vnni")
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx", "avx2", "fma"}))  # not all of x86-64-v3
    assert cpu.runnable_kernel_isas() == ("portable",) and cpu.kernel_isa() == "portable"


def test_the_response_cache_fingerprint_names_the_build(monkeypatch):
    from specdecode.cache.response_cache import kernel_fingerprint

    monkeypatch.delenv(cpu.KERNEL_ISA_VARIABLE, raising=False)
    chosen = kernel_fingerprint()
    assert chosen[-1] == kernel_isas()[0]
    for isa in kernel_isas()[1:]:
        monkeypatch.setenv(cpu.KERNEL_ISA_VARIABLE, isa)
        assert kernel_fingerprint()[-1] == isa and kernel_fingerprint() != chosen
