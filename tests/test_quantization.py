"""Weight-only int8: the product equals the one with the dequantized weight."""

import pytest
import torch

from helpers import tiny_gpt2, tiny_llama
from specdecode.runners import CachedSequence, runner_for
from specdecode.runners.fast_llama import FastLlamaRunner
from specdecode.runners.projection import projection


def test_int8_rounding_error_is_at_most_half_a_step():
    weight = torch.randn(48, 32)
    int8 = projection(weight, None, "int8")
    assert int8.weight.dtype == torch.int8
    dequantized = int8.weight.float() * int8.scales[:, None]
    assert ((dequantized - weight).abs() <= int8.scales[:, None] / 2 + 1e-7).all()


def test_int8_product_equals_the_product_with_the_dequantized_weight():
    weight, bias, x = torch.randn(48, 32), torch.randn(48), torch.randn(5, 32)
    int8 = projection(weight, bias, "int8")
    expected = x @ (int8.weight.float() * int8.scales[:, None]).T + bias
    torch.testing.assert_close(int8(x), expected, atol=1e-4, rtol=1e-4)


def test_int8_runner_stays_close_to_full_precision():
    model = tiny_llama(seed=3, init=0.1)
    full, int8 = CachedSequence(runner_for(model)), CachedSequence(runner_for(model, quantization="int8"))
    tokens = [3, 5, 7, 2, 9, 11, 4]
    full_logits, int8_logits = full.logits(tokens, 4), int8.logits(tokens, 4)
    assert isinstance(int8.runner, FastLlamaRunner)
    assert (int8_logits - full_logits).abs().max() < 0.05 * full_logits.abs().max()


def test_int8_is_refused_where_it_does_not_run():
    with pytest.raises(ValueError, match="runs on the Llama-family fast runner"):
        runner_for(tiny_gpt2(seed=1), quantization="int8")


def test_packed_products_equal_plain_ones_whatever_the_padding():
    """Rows padded up to a packed size give the plain product, and a row's value does not
    depend on the rows beside it (so a sequence gets the same numbers alone or in a batch)."""
    torch.manual_seed(0)
    weight, bias = torch.randn(48, 32), torch.randn(48)
    plain, packed = projection(weight, bias, None), projection(weight, bias, None, (8, 16))
    if not packed.packed:
        pytest.skip("no MKL packed GEMM in this torch build")
    x = torch.randn(20, 32)
    for n in range(1, 21):
        torch.testing.assert_close(packed(x[:n]), plain(x[:n]), atol=1e-5, rtol=1e-5)
    assert torch.equal(packed(x[:6])[0], packed(x[:8])[0])  # both padded to 8 rows
