"""Weight-only int8: the product equals the one with the dequantized weight. bitsandbytes nf4,
fp4 and int8 targets (--quantization) and 4-bit self-drafts: exact relative to the quantized model."""

import copy
import dataclasses
import logging

import bitsandbytes as bnb
import pytest
import torch
from transformers import DynamicCache

from helpers import (
    ALPHA,
    DIST_VOCAB,
    GREEDY_PROMPTS,
    assert_drafted_and_accepted,
    bnb_llama,
    exact_joint,
    g_test_pvalue,
    hf_greedy,
    sample_counts,
    tiny_gpt2,
    tiny_llama,
    tiny_tokenizer,
)
from specdecode import SpeculativeEngine, loading, precision
from specdecode.drafters import ModelDrafter, self_quantized_drafter
from specdecode.drafters.factory import DrafterOptions, check_drafter_options
from specdecode.drafters.self_quantized import quantized_copy
from specdecode.loading import load_model, precision_of, quantization_of
from specdecode.runners import CachedSequence, HFModelRunner, runner_for
from specdecode.runners.fast_llama import FastLlamaRunner
from specdecode.runners.projection import projection
from specdecode.runners.rowwise import rowwise_sdpa, verifying


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
    with pytest.raises(ValueError, match="runs on the fast runners, not on gpt2"):
        runner_for(tiny_gpt2(seed=1), quantization="int8")


def test_float32_products_keep_one_reordered_copy_and_rows_apart():
    """On the CPU a float32 weight is kept once, in oneDNN's layout; its products are
    F.linear's to rounding, and a row's value does not depend on the rows beside it (so a
    sequence gets the same numbers alone or in a batch)."""
    torch.manual_seed(0)
    weight, bias = torch.randn(48, 32), torch.randn(48)
    product = projection(weight, bias, None)
    if not product.reordered:
        pytest.skip("no oneDNN in this torch build")
    assert product.nbytes == weight.nbytes + bias.nbytes
    x = torch.randn(20, 32)
    torch.testing.assert_close(product(x), torch.nn.functional.linear(x, weight, bias), atol=1e-5, rtol=1e-5)
    alone = torch.cat([product(x[i : i + 1]) for i in range(20)])
    assert torch.equal(product(x), alone)


# --- bitsandbytes nf4 / fp4 / int8 targets (loading.py, --quantization) ---

BNB = ["nf4", "fp4", "int8"]


def saved(model, folder) -> str:
    model.save_pretrained(folder)
    tiny_tokenizer(model.config.vocab_size).save_pretrained(folder)
    return str(folder)


def quantized(model, quantization, folder):
    """model saved as a local folder and loaded back quantized, as --quantization loads a target."""
    return load_model(saved(model, folder), "cpu", "float32", quantization=quantization)[0]


def dequantized(qmodel, original):
    """original with every bitsandbytes layer's weight replaced by what that layer multiplies by:
    the quantized model's distribution, computed by transformers' own float modules. Call it
    before qmodel's first forward (on the CPU the first forward repacks the 4-bit codes)."""
    copy_ = copy.deepcopy(original)
    modules = dict(copy_.named_modules())
    for name, module in qmodel.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            weight = bnb.functional.dequantize_4bit(module.weight.data, module.weight.quant_state)
        elif isinstance(module, bnb.nn.Linear8bitLt):
            weight = module.weight.data.float() * module.weight.SCB.float()[:, None] / 127
        else:
            continue
        modules[name].weight.data.copy_(weight.float())
    return copy_


@pytest.mark.parametrize("quantization", BNB)
def test_quantized_target_loads_from_a_folder_and_runs_on_transformers_runner(quantization, tmp_path):
    qmodel = quantized(bnb_llama(seed=1), quantization, tmp_path)
    name = precision.quantization_named(quantization).name  # "int8", the older spelling, is llm-int8
    assert quantization_of(qmodel) == name
    assert precision_of(qmodel).startswith(f"{name} (bitsandbytes")
    assert isinstance(runner_for(qmodel), HFModelRunner)  # never the fast path, which reads raw weights
    with pytest.raises(ValueError, match="transformers runner"):
        runner_for(qmodel, "fast")
    engine = SpeculativeEngine(qmodel, tiny_tokenizer())
    stats = engine.generate([[3, 5, 7, 2]], max_new_tokens=4)[0].stats
    assert stats.target_precision == precision_of(qmodel) and "float32 elsewhere" in stats.target_precision


@pytest.mark.parametrize("quantization", BNB)
def test_greedy_speculation_over_a_quantized_target_equals_its_own_generate(quantization, tmp_path):
    """Exact relative to the quantized model: the float model drafts, the quantized one verifies,
    and the output is the quantized model's greedy generate, token for token."""
    original = bnb_llama(seed=2)
    qmodel = quantized(original, quantization, tmp_path)
    engine = SpeculativeEngine(qmodel, drafter=ModelDrafter(HFModelRunner(original)), num_speculative_tokens=3)
    results = engine.generate(GREEDY_PROMPTS, max_new_tokens=20)
    expected = [hf_greedy(qmodel, p, 20) for p in GREEDY_PROMPTS]
    assert [r.token_ids for r in results] == expected
    assert_drafted_and_accepted(results, quantization)
    # negative control: the float model's own greedy output is another sequence (quantizing changed the model)
    assert [hf_greedy(original, p, 20) for p in GREEDY_PROMPTS] != expected


def test_sampling_over_an_nf4_target_keeps_the_quantized_distribution(tmp_path):
    """G-test against the nf4 model's exact law (its dequantized weights, in float64); negative
    control: the same samples against the float model it was quantized from must be rejected."""
    params = dict(temperature=1.0)
    original = bnb_llama(seed=1, vocab_size=DIST_VOCAB)
    qmodel = quantized(original, "nf4", tmp_path)
    reference = dequantized(qmodel, original)
    engine = SpeculativeEngine(qmodel, drafter=ModelDrafter(HFModelRunner(original)), num_speculative_tokens=3)
    counts = sample_counts(engine, 3, params, seed=21)
    assert g_test_pvalue(counts, exact_joint(reference, params)) > ALPHA
    assert g_test_pvalue(counts, exact_joint(original, params)) < ALPHA


@pytest.mark.parametrize("quantization", ["nf4", "fp4"])
def test_4bit_self_draft_is_exact_and_quantized_as_transformers_quantizes(quantization, tmp_path):
    target = bnb_llama(seed=3)
    drafter = self_quantized_drafter(target, quantization)
    assert drafter.name == f"self-quantized-{quantization}"
    engine = SpeculativeEngine(target, drafter=drafter, num_speculative_tokens=4)
    results = engine.generate(GREEDY_PROMPTS, max_new_tokens=20)
    assert [r.token_ids for r in results] == [hf_greedy(target, p, 20) for p in GREEDY_PROMPTS]
    assert_drafted_and_accepted(results, quantization)
    # the in-memory copy holds the codes transformers' BitsAndBytesConfig gives the same weights
    copy_, loaded = quantized_copy(target, quantization), quantized(target, quantization, tmp_path)
    for name, module in loaded.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            mine = copy_.get_submodule(name).weight
            assert torch.equal(mine.data, module.weight.data), name
            assert torch.equal(mine.quant_state.absmax, module.weight.quant_state.absmax), name


def test_self_quantized_drafter_refuses_an_already_quantized_target(tmp_path):
    qmodel = quantized(bnb_llama(seed=1), "nf4", tmp_path)
    with pytest.raises(ValueError, match="already quantized"):
        self_quantized_drafter(qmodel, "bfloat16")


def test_draft_quantization_applies_to_the_self_quantized_drafter_only():
    check_drafter_options("self-quantized", DrafterOptions(draft_quantization="nf4"))
    check_drafter_options("auto", DrafterOptions())
    for name in ("auto", "prompt-lookup", "model", "none"):
        with pytest.raises(ValueError, match="self-quantized drafter only") as error:
            check_drafter_options(name, DrafterOptions(draft_quantization="nf4"))
        assert error.value.param == "draft_quantization"
    with pytest.raises(ValueError, match="unknown draft quantization 'int4'"):
        check_drafter_options("self-quantized", DrafterOptions(draft_quantization="int4"))


def test_compute_dtype_is_bfloat16_only_where_the_cpu_multiplies_it(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(loading, "cpu_flags", lambda: {"avx2", "avx512_bf16"})
    assert loading.bnb_compute_dtype(cpu) == torch.bfloat16
    monkeypatch.setattr(loading, "cpu_flags", lambda: {"avx2", "amx_bf16"})
    assert loading.bnb_compute_dtype(cpu) == torch.bfloat16
    monkeypatch.setattr(loading, "cpu_flags", lambda: {"avx2"})
    assert loading.bnb_compute_dtype(cpu) == torch.float32
    assert loading.bnb_config("nf4", cpu).bnb_4bit_compute_dtype == torch.float32


def test_clear_errors_where_bitsandbytes_cannot_run(monkeypatch):
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="CPU or CUDA here, not on mps"):
        loading.check_bitsandbytes(torch.device("mps"))
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    with pytest.raises(ValueError, match="needs an x86 CPU with AVX2"):
        loading.check_bitsandbytes(cpu)
    monkeypatch.undo()
    find_spec = loading.importlib.util.find_spec
    monkeypatch.setattr(
        loading.importlib.util, "find_spec", lambda name: None if name == "bitsandbytes" else find_spec(name)
    )
    with pytest.raises(ValueError, match="needs the bitsandbytes package, which is not installed"):
        loading.check_bitsandbytes(cpu)


def test_unknown_quantization_is_refused_before_loading():
    with pytest.raises(ValueError, match="unknown quantization 'int4'") as error:
        SpeculativeEngine.from_pretrained("no-such-model", quantization="int4")
    assert error.value.param == "quantization"


def test_a_model_bitsandbytes_cannot_lay_out_is_a_clear_error(tmp_path):
    if not bnb.functional.has_avx512bf16():
        pytest.skip("only bitsandbytes' AVX512-BF16 kernel lays 4-bit weights out in blocks of 32 rows")
    with pytest.raises(ValueError, match="multiple of 32 outputs, and model.layers.0.self_attn.k_proj has 16"):
        quantized(tiny_llama(seed=0), "nf4", tmp_path)  # key/value projections of 16 outputs
    with pytest.raises(ValueError, match="multiple of 32 outputs"):
        self_quantized_drafter(tiny_llama(seed=0), "nf4")


def hidden_rows(model, prompt: list[int], new: list[int], together: bool) -> torch.Tensor:
    """The last layer's hidden states of `new` after `prompt`: in one forward, run as
    transformers' runner runs a verification, or one forward per token."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(torch.tensor([prompt]), past_key_values=cache, use_cache=True)
        if together:
            with verifying():
                outs = [model(torch.tensor([new]), past_key_values=cache, output_hidden_states=True)]
        else:
            outs = [model(torch.tensor([[t]]), past_key_values=cache, output_hidden_states=True) for t in new]
    return torch.cat([o.hidden_states[-1][0] for o in outs])


@pytest.mark.parametrize("quantization", BNB)
def test_a_verification_forward_over_a_quantized_model_gives_each_row_its_one_token_bits(quantization, tmp_path):
    """bitsandbytes rounds layer inputs to bfloat16, so row-dependent rounding elsewhere became
    whole bfloat16 steps between verified rows and one-token decoding (0.22 logits on the
    default model in nf4), and LLM.int8 treats a column as an outlier if any row has one."""
    qmodel = quantized(bnb_llama(seed=2), quantization, tmp_path)
    prompt, new = [3, 5, 7, 2, 9, 1, 12], [11, 4, 6, 8, 10]
    HFModelRunner(qmodel)  # makes its rows exact
    assert torch.equal(hidden_rows(qmodel, prompt, new, True), hidden_rows(qmodel, prompt, new, False))


FOUR_BIT_ON_TORCH = pytest.param(
    "nf4",
    marks=pytest.mark.skipif(
        bnb.functional.has_avx512bf16(), reason="bitsandbytes' own 4-bit kernel (AVX512-BF16) keeps rows apart"
    ),
)


@pytest.mark.parametrize("quantization", ["int8", FOUR_BIT_ON_TORCH])
def test_layers_run_one_row_at_a_time_depend_on_their_neighbours_outside_verification(quantization, tmp_path):
    """The negative control of the int8 case above, and of 4-bit on a CPU where torch's product
    multiplies its dequantized weight: the same forward, not marked as a verification."""
    qmodel = quantized(bnb_llama(seed=2), quantization, tmp_path)
    HFModelRunner(qmodel)
    prompt, new = [3, 5, 7, 2, 9, 1, 12], [11, 4, 6, 8, 10]
    cache = DynamicCache(config=qmodel.config)
    with torch.inference_mode():
        qmodel(torch.tensor([prompt]), past_key_values=cache, use_cache=True)
        together = qmodel(torch.tensor([new]), past_key_values=cache, output_hidden_states=True).hidden_states[-1][0]
    assert not torch.equal(together, hidden_rows(qmodel, prompt, new, False))


def test_rowwise_attention_gives_each_query_its_one_query_bits():
    """Shapes of the default model (9 query heads over 3 key/value heads of 64, 200 cached
    positions); negative control: SDPA over the 5 queries at once rounds them otherwise."""
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    torch.manual_seed(0)
    module = SimpleNamespace(num_key_value_groups=3, is_causal=True, training=False)
    query, key, value = torch.randn(1, 9, 5, 64), torch.randn(1, 3, 205, 64), torch.randn(1, 3, 205, 64)
    alone = torch.cat(
        [
            sdpa_attention_forward(module, query[:, :, i : i + 1], key[:, :, : 201 + i], value[:, :, : 201 + i], None)[
                0
            ]
            for i in range(5)
        ],
        dim=1,
    )
    assert torch.equal(rowwise_sdpa(module, query, key, value, None)[0], alone)
    mask = torch.arange(205)[None, :] <= torch.arange(200, 205)[:, None]  # [5 queries, 205 keys]
    together = sdpa_attention_forward(module, query, key, value, mask[None, None])[0]
    assert not torch.equal(together, alone)


def test_4bit_keeps_down_projections_in_float_on_row_independent_products(tmp_path, monkeypatch):
    """loading.FOUR_BIT_KEEPS: the MLPs' down projections stay in --dtype (nf4 perplexity +9.0%
    -> +3.9% on the default model); transformers' runner runs them on oneDNN's products, whose
    rows keep their bits alone or among others, and frees their originals at release."""
    original = bnb_llama(seed=4)
    qmodel = quantized(original, "nf4", tmp_path / "kept")
    down = qmodel.model.layers[0].mlp.down_proj
    assert type(down) is torch.nn.Linear and isinstance(qmodel.model.layers[0].mlp.up_proj, bnb.nn.Linear4bit)
    runner = HFModelRunner(qmodel)
    x = torch.randn(6, down.in_features)
    assert torch.equal(down(x), torch.cat([down(x[i : i + 1]) for i in range(6)]))
    torch.testing.assert_close(down(x), torch.nn.functional.linear(x, down.weight), atol=1e-5, rtol=1e-5)
    before = SpeculativeEngine(runner).generate(GREEDY_PROMPTS[:2], max_new_tokens=8)
    runner.release_model_weights()
    assert down.weight.is_meta
    after = SpeculativeEngine(runner).generate(GREEDY_PROMPTS[:2], max_new_tokens=8)
    assert [r.token_ids for r in after] == [r.token_ids for r in before]
    # control: without the keep list every projection is 4-bit
    monkeypatch.setattr(loading, "FOUR_BIT_KEEPS", ("lm_head",))
    every = quantized(original, "nf4", tmp_path / "every")
    assert isinstance(every.model.layers[0].mlp.down_proj, bnb.nn.Linear4bit)


# --- precision.py: one name per precision, older spellings accepted ---


def test_each_spelling_names_one_precision_for_its_option():
    assert precision.quantization_named("int8", precision.TARGET).name == "llm-int8"  # as before: LLM.int8
    assert precision.quantization_named("llm-int8", precision.TARGET).bitsandbytes
    assert precision.quantization_named("int8", precision.RUNNER).name == "int8-weight-only"
    assert precision.quantization_named("int8", precision.DRAFT).name == "int8-weight-only"
    assert precision.quantization_named("w8a8", precision.TARGET).runner == "fast"
    assert precision.quantization_named(None) is None
    with pytest.raises(
        ValueError, match="unknown quantization 'w8a8'; choose one of: nf4, fp4, int8-weight-only"
    ) as error:
        precision.quantization_named("w8a8", precision.DRAFT)
    assert error.value.param == "draft_quantization"
    assert precision.dtype_named("bf16").dtype == torch.bfloat16 and precision.dtype_named("auto") is None
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        precision.dtype_named("int8")  # 8 bits are a quantization, not a dtype
    assert precision.quantization_named("llm-int8").bitsandbytes and not precision.W8A8.bitsandbytes


def test_dtype_auto_never_quantizes_and_keeps_its_choice_for_what_stays_in_float():
    cpu = torch.device("cpu")
    native = precision.Circumstances(cpu, fast_path=True, native_bfloat16=True)
    assert precision.resolve("auto", None, native).dtype == torch.bfloat16
    assert precision.resolve("auto", "w8a8", native).dtype == torch.bfloat16
    assert precision.resolve("auto", "llm-int8", native).dtype == torch.float32
    assert precision.resolve("auto", "int8", native).dtype == torch.float32  # the older spelling
    assert precision.resolve("auto", None, precision.Circumstances(cpu, fast_path=True)).dtype == torch.float32
    assert precision.resolve("auto", None, precision.Circumstances(cpu)).dtype == torch.float32  # a model alone
    assert precision.resolve("fp32", None, native).dtype == torch.float32


def test_an_older_spelling_keeps_its_meaning_with_one_line_once(monkeypatch, caplog):
    monkeypatch.setattr(precision, "_warned", set())  # warned once a process: start afresh
    with caplog.at_level(logging.WARNING, logger="specdecode.precision"):
        assert precision.draft_precision_named("int8") is precision.INT8_WEIGHT_ONLY
        assert precision.draft_precision_named("int8") is precision.INT8_WEIGHT_ONLY
        assert precision.draft_precision_named("int8-weight-only") is precision.INT8_WEIGHT_ONLY  # no warning
    assert [r.getMessage() for r in caplog.records] == [
        "--draft-quantization int8 is an older spelling of --draft-quantization int8-weight-only (the same); "
        "it will be removed"
    ]


def test_a_resolved_precision_is_one_immutable_object_that_loaders_and_runners_read():
    w8a8 = precision.resolve("bf16", "w8a8")
    assert (w8a8.dtype, w8a8.name, w8a8.chosen) == (torch.bfloat16, "w8a8, bfloat16 elsewhere", False)
    assert w8a8.runner_quantization is precision.W8A8 and w8a8.loaded_quantized is None
    assert w8a8.in_float() == precision.Precision(torch.bfloat16)
    nf4 = precision.resolve("float32", precision.NF4)  # an object passes as it is
    assert nf4 == precision.resolve("float32", "nf4") and nf4.loaded_quantized is precision.NF4
    assert precision.resolve().chosen and precision.resolve().name == "float32"
    with pytest.raises(dataclasses.FrozenInstanceError):
        w8a8.dtype = torch.float32  # type: ignore[misc]
    with pytest.raises(ValueError, match="unknown draft quantization 'w8a8'; choose one of: bfloat16, nf4, fp4"):
        precision.draft_precision_named("w8a8")
    with pytest.raises(ValueError, match="unknown quantization 'nf4'; choose one of: w8a8, int8-weight-only"):
        runner_for(tiny_llama(seed=1), quantization=precision.NF4)  # bitsandbytes' kinds load quantized


def test_w8a8_is_not_a_bitsandbytes_config():
    with pytest.raises(ValueError, match="w8a8 is quantized by the fast runner"):
        loading.bnb_config("w8a8", torch.device("cpu"))
