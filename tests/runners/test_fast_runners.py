"""The fast paths (Llama family, GPT-2) give transformers' logits, through prefill, drafts and rollbacks.

Tolerance: float32 logits within atol = rtol = 1e-5 of transformers' (in practice they are
bitwise equal on this CPU: the same products in the same order); bfloat16 within 2e-2.
"""

import pytest
import torch
import torch.nn.functional as F
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MambaConfig,
    MambaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from helpers import GREEDY_PROMPTS as PROMPTS
from helpers import (
    assert_drafted_and_accepted,
    head64_llama,
    hf_greedy,
    tiny_causal_lm,
    tiny_gpt2,
    tiny_llama,
    verified_differs_from_alone,
)
from specdecode import SpeculativeEngine
from specdecode.cpu import cpu_flags
from specdecode.drafters import PromptLookupDrafter
from specdecode.runners import CachedSequence, HFModelRunner, fast_llama, runner_for, slots
from specdecode.runners import projection as quantization
from specdecode.runners.fast_gpt2 import FastGPT2Runner
from specdecode.runners.fast_llama import FastLlamaRunner
from specdecode.runners.static_cache import StaticKVCache


def tiny_qwen2(seed: int):
    model = tiny_causal_lm(Qwen2ForCausalLM, Qwen2Config, seed, initializer_range=0.3, use_sliding_window=False)
    with torch.no_grad():  # random init leaves the q/k/v biases at zero; make them count
        for layer in model.model.layers:
            layer.self_attn.q_proj.bias.normal_(0, 0.3)
            layer.self_attn.k_proj.bias.normal_(0, 0.3)
    return model


def tiny_mistral(seed: int):
    return tiny_causal_lm(
        MistralForCausalLM, MistralConfig, seed, num_key_value_heads=1, initializer_range=0.3, sliding_window=None
    )


def tiny_llama_with_biases(seed: int):
    """attention_bias=True: transformers' Llama then has a bias on q, k, v and o_proj."""
    model = tiny_causal_lm(
        LlamaForCausalLM,
        LlamaConfig,
        seed,
        initializer_range=0.3,
        attention_bias=True,
        eos_token_id=None,
        bos_token_id=None,
    )
    with torch.no_grad():  # random init leaves every bias at zero; make them all count
        for layer in model.model.layers:
            attn = layer.self_attn
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
                proj.bias.normal_(0, 0.5)
    assert all(layer.self_attn.o_proj.bias.abs().min() > 0 for layer in model.model.layers)
    return model


# what a speculative run asks: prefill, verify drafts, roll back, verify again, ...
STEPS = [(list(range(1, 21)), 1), (list(range(1, 26)), 6), (list(range(1, 23)) + [5, 6], 3), (list(range(1, 24)), 1)]


@pytest.mark.parametrize(
    "family",
    [tiny_llama, tiny_llama_with_biases, tiny_qwen2, tiny_mistral, tiny_gpt2],
    ids=["llama", "llama-biases", "qwen2", "mistral", "gpt2"],
)
def test_logits_match_transformers_through_rollbacks(family):
    model = family(seed=3)
    fast, reference = CachedSequence(runner_for(model, "fast")), CachedSequence(HFModelRunner(model))
    for tokens, num_logits in STEPS:
        tokens = [t % 24 for t in tokens]
        torch.testing.assert_close(
            fast.logits(tokens, num_logits), reference.logits(tokens, num_logits), atol=1e-5, rtol=1e-5
        )


def test_bfloat16_logits_are_close_to_transformers_bfloat16():
    model = tiny_llama(seed=3).to(torch.bfloat16)
    fast, reference = CachedSequence(FastLlamaRunner(model)), CachedSequence(HFModelRunner(model))
    for tokens, num_logits in STEPS:
        tokens = [t % 24 for t in tokens]
        torch.testing.assert_close(
            fast.logits(tokens, num_logits), reference.logits(tokens, num_logits), atol=2e-2, rtol=2e-2
        )


def half_precision_llama(dtype: torch.dtype = torch.bfloat16, hidden: int = 64, heads: int = 4) -> FastLlamaRunner:
    """Big enough (head_dim 16, 256-token contexts) for the batched attention kernel to round
    1 and 6 queries differently on this CPU; small enough to run in a second."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    return FastLlamaRunner(LlamaForCausalLM(config).eval().to(dtype))


# The negative controls below show the rounding that per-query attention and 32-row products
# remove, as the CPUs they were measured on round it; other CPUs' kernels may round those
# calls alike by chance, so there the controls are skipped (the exactness checks still run).
# Batched attention was seen to differ on AMX CPUs and, since queries of a key/value head
# share one call (attention._sdpa), on CPUs with AVX512-BF16 and no AMX, and on AVX2 CPUs.
AMX = "amx_bf16" in cpu_flags()
needs_amx = pytest.mark.skipif(not AMX, reason="the negative control was measured on an AMX CPU")
needs_bf16_cpu = pytest.mark.skipif(
    "avx512_bf16" not in cpu_flags(), reason="the negative control was measured on CPUs with AVX512-BF16"
)
needs_measured_attention = pytest.mark.skipif(
    "avx512_bf16" not in cpu_flags() and "avx512f" in cpu_flags(),
    reason="batched attention was measured to round otherwise on CPUs with AVX512-BF16 and on AVX2 CPUs",
)


def half_precision_gpt2(dtype: torch.dtype) -> FastGPT2Runner:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=512, eos_token_id=None, bos_token_id=None
    )
    return FastGPT2Runner(GPT2LMHeadModel(config).eval().to(dtype))


# oneDNN multiplies float16 where the CPU has AVX512-FP16 or AVX-NE-CONVERT (bfloat16: AVX512-BF16
# or AMX); elsewhere its products run widened to float32 (projection.onednn_dtype), rows apart too
HALF_DTYPES = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("make", [half_precision_llama, half_precision_gpt2], ids=["llama", "gpt2"])
@pytest.mark.parametrize("dtype", [torch.float32, *HALF_DTYPES])
def test_verification_on_the_cpu_gives_each_token_its_logits_decoded_alone(make, dtype):
    runner = make(dtype)
    assert runner.per_query_attention  # on by default on the CPU, float32 included (oneDNN products)
    assert verified_differs_from_alone(runner) == 0


@needs_measured_attention
@pytest.mark.parametrize("make", [half_precision_llama, half_precision_gpt2], ids=["llama", "gpt2"])
@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_half_precision_verification_without_per_query_attention_would_differ(make, dtype):
    """Negative control of the test above: the batched kernel does round differently."""
    runner = make(dtype)
    runner.per_query_attention = False
    assert verified_differs_from_alone(runner) > 0


def batched_differs_from_alone(runner: FastLlamaRunner) -> int:
    """How many logits rows of 4 sequences, prefilled together (58 stacked rows) and then
    verifying 5 tokens each together, differ bitwise from those sequences run alone."""
    generator = torch.Generator().manual_seed(2)
    sequences = [torch.randint(0, 256, (n,), generator=generator) for n in (30, 12, 21, 10)]

    def run(group: list[torch.Tensor]) -> list[torch.Tensor]:
        caches = [runner.new_cache() for _ in group]
        prefills = runner.forward_batch(caches, [s[:-5] for s in group], [1] * len(group))
        verifications = runner.forward_batch(caches, [s[-5:] for s in group], [5] * len(group))
        return [torch.cat(pair) for pair in zip(prefills, verifications)]

    alone = [run([s])[0] for s in sequences]
    together = run(sequences)
    return sum(int((a != b).any(dim=-1).sum()) for a, b in zip(alone, together))


@pytest.mark.parametrize("dtype", [torch.float32, *HALF_DTYPES])
def test_batches_on_the_cpu_give_each_sequence_its_logits_alone(dtype):
    """What makes batched serving answer as one request at a time does. SmolLM2's width:
    narrower products keep their rows apart even past 32 rows, so the control below could
    not fail."""
    assert batched_differs_from_alone(half_precision_llama(dtype, hidden=576, heads=8)) == 0


@needs_amx
def test_bfloat16_products_of_more_than_32_rows_would_tie_a_sequence_to_its_batch(monkeypatch):
    """Negative control of the test above: without the 32-row chunks, rows do differ."""
    monkeypatch.setattr(quantization, "ONEDNN_INVARIANT_ROWS", 1 << 20)
    assert batched_differs_from_alone(half_precision_llama(torch.bfloat16, hidden=576, heads=8)) > 0


def test_bfloat16_speculation_reproduces_bfloat16_target_only_decoding():
    """Lossless in half precision too: the same tokens as decoding the bfloat16 target alone,
    one sequence at a time and batched."""
    engine = SpeculativeEngine(half_precision_llama(), drafter=PromptLookupDrafter(), num_speculative_tokens=6)
    prompts = [[7, 8, 9, 10, 11, 7, 8, 9, 10, 11, 7, 8] * 3, list(range(40, 90)), [3, 1, 4, 1, 5, 9, 2, 6] * 4]
    target_only = [r.token_ids for r in engine.generate(prompts, max_new_tokens=60, speculative=False)]
    speculative = engine.generate(prompts, max_new_tokens=60)
    assert sum(r.stats.accepted_tokens for r in speculative) > 0  # drafts were verified and kept
    assert [r.token_ids for r in speculative] == target_only
    batched = engine.generate(prompts, max_new_tokens=60, max_batch_size=3)
    assert [r.token_ids for r in batched] == target_only


def test_cache_grows_past_its_initial_capacity(monkeypatch):
    monkeypatch.setattr(slots, "SLOT_CAPACITY", 8)
    grown = []
    grow = StaticKVCache._grow
    monkeypatch.setattr(StaticKVCache, "_grow", lambda cache, capacity: (grown.append(capacity), grow(cache, capacity)))
    model = tiny_llama(seed=3)
    engine = SpeculativeEngine(FastLlamaRunner(model), drafter=PromptLookupDrafter(), num_speculative_tokens=3)
    result = engine.generate([PROMPTS[1]], max_new_tokens=40)[0]
    assert max(grown) >= len(PROMPTS[1]) + 40 - 1  # the sequence's slot grew to hold it
    assert result.token_ids == hf_greedy(model, PROMPTS[1], 40)
    assert_drafted_and_accepted([result])


def test_runner_choice():
    assert isinstance(runner_for(tiny_llama(seed=1)), FastLlamaRunner)
    assert isinstance(runner_for(tiny_gpt2(seed=1)), FastGPT2Runner)
    assert isinstance(runner_for(tiny_llama(seed=1), "transformers"), HFModelRunner)
    unsupported = MambaForCausalLM(MambaConfig(vocab_size=24, hidden_size=32, num_hidden_layers=1))
    assert isinstance(runner_for(unsupported), HFModelRunner)  # transformers' own path
    with pytest.raises(ValueError, match="no fast runner runs mamba"):
        runner_for(unsupported, "fast")
    with pytest.raises(ValueError, match="unknown runner"):
        runner_for(tiny_llama(seed=1), "turbo")
    assert not fast_llama.supports(
        MistralForCausalLM(
            MistralConfig(
                vocab_size=24,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=4,
                num_key_value_heads=1,
                sliding_window=16,
            )
        )
    )


def test_longrope_is_left_to_transformers():
    """longrope switches its frequencies by the sequence's current length (short factors up
    to original_max_position_embeddings, long beyond); the fast path's rope tables are
    computed once for its cache capacity, so it would rotate short sequences with the long
    factors (logits measured ~8 off). supports() must refuse it; static rope scalings stay."""
    head_dim = 8

    def llama(rope_parameters: dict) -> LlamaForCausalLM:
        return tiny_causal_lm(
            LlamaForCausalLM,
            LlamaConfig,
            0,
            num_hidden_layers=1,
            max_position_embeddings=64,
            rope_parameters={"rope_theta": 10000.0, **rope_parameters},
        )

    longrope = llama(
        {
            "rope_type": "longrope",
            "short_factor": [1.0] * (head_dim // 2),
            "long_factor": [4.0] * (head_dim // 2),
            "original_max_position_embeddings": 16,
        }
    )
    assert not fast_llama.supports(longrope)
    assert isinstance(runner_for(longrope), HFModelRunner)  # nor the generic fast runner
    assert fast_llama.supports(llama({"rope_type": "linear", "factor": 2.0}))
    assert fast_llama.supports(llama({"rope_type": "dynamic", "factor": 2.0}))


def one_row_vs_batched_differences(product, inputs: int = 1536, rows: int = 64, dtype=torch.bfloat16) -> int:
    """Rows whose bits differ between a product of that row alone and of up to 32 rows with it,
    for a weight of SmolLM2's down projection's shape (the one seen to differ) and random rows."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, inputs, generator=generator).to(dtype)
    alone = torch.cat([product(x[i : i + 1]) for i in range(rows)])
    together = torch.cat([product(chunk) for chunk in x.split(32)])
    return int((alone != together).any(dim=1).sum())


def test_bfloat16_rows_get_the_same_bits_alone_and_among_others():
    weight = torch.randn(576, 1536, generator=torch.Generator().manual_seed(1)).bfloat16()
    assert one_row_vs_batched_differences(quantization.projection(weight, None, None)) == 0


@pytest.fixture
def onednn_multiplies_float32_only(monkeypatch):
    """oneDNN as on a CPU without AVX512-BF16, AMX or AVX512-FP16 (an AVX2 one), on any CPU."""
    monkeypatch.setattr(quantization, "onednn_supports", lambda dtype: dtype == torch.float32)


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_where_onednn_multiplies_float32_only_half_precision_runs_widened_and_exact(
    onednn_multiplies_float32_only, dtype
):
    weight = torch.randn(576, 1536, generator=torch.Generator().manual_seed(1)).to(dtype)
    product = quantization.projection(weight, torch.ones(576, dtype=dtype), None)
    assert product.reordered and product.weight.dtype == product.bias.dtype == torch.float32
    assert one_row_vs_batched_differences(product, dtype=dtype) == 0
    x = torch.randn(5, 1536, generator=torch.Generator().manual_seed(2)).to(dtype)
    y = product(x)  # accumulated in float32, rounded once: F.linear's result to its rounding
    assert y.dtype == dtype
    torch.testing.assert_close(y, F.linear(x.float(), weight.float(), torch.ones(576)).to(dtype))
    runner = half_precision_llama(dtype)
    assert runner.per_query_attention and runner.batch_invariant
    assert verified_differs_from_alone(runner) == 0


AVX512 = "avx512f" in cpu_flags()


@pytest.mark.skipif(not AVX512, reason="without AVX-512 every one-row product pads (kernels not measured)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_row_products_of_at_most_1024_inputs_run_unpadded_with_the_same_bits(dtype):
    """Up to 1024 inputs oneDNN's one-row kernel gives a row the bits the many-row kernel gives
    it, so such products (SmolLM2's q|k|v, o, gate|up and head) skip the padding; beyond, they
    pad. The negative control is the test below, at 1088 and 1536 inputs."""
    for inputs in (576, 1024):
        weight = torch.randn(512, inputs, generator=torch.Generator().manual_seed(1)).to(dtype)
        product = quantization.projection(weight, None, None)
        assert not product.pad_one_row
        assert one_row_vs_batched_differences(product, inputs, rows=256, dtype=dtype) == 0
    wider = quantization.projection(torch.zeros(512, 1088, dtype=dtype), None, None)
    assert wider.pad_one_row == (dtype == torch.float32 or not AMX)


@needs_bf16_cpu
@pytest.mark.skipif(AMX, reason="measured on a CPU without AMX, whose one-row kernel rounds differently")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inputs", [1088, 1536])
def test_one_row_products_of_over_1024_inputs_unpadded_would_differ_without_amx(inputs, dtype):
    """Negative control of the tests above: oneDNN's one-row kernel alone does round differently."""
    weight = torch.randn(576, inputs, generator=torch.Generator().manual_seed(1)).to(dtype)
    product = quantization.projection(weight, None, None)
    assert one_row_vs_batched_differences(product._onednn_kernel, inputs, rows=256, dtype=dtype) > 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_engine_keeps_one_copy_of_the_weights_and_decodes_as_with_two(tiny_model_dir, dtype):
    """from_pretrained frees the transformers model's copies of what the fast runner holds in
    oneDNN's layout; the outputs are those of an engine that kept them, and the model, asked to
    run, says how to keep it."""
    released = SpeculativeEngine.from_pretrained(tiny_model_dir, dtype=dtype, drafter="prompt-lookup")
    kept = SpeculativeEngine.from_pretrained(
        tiny_model_dir, dtype=dtype, drafter="prompt-lookup", keep_model_weights=True
    )
    layer = released.target_runner.model.model.layers[0]
    assert layer.self_attn.q_proj.weight.is_meta and layer.mlp.down_proj.weight.is_meta
    assert not kept.target_runner.model.model.layers[0].self_attn.q_proj.weight.is_meta
    assert released.model_fingerprint() == kept.model_fingerprint()  # the caches key the same model
    ours, theirs = (e.generate(PROMPTS[:2], max_new_tokens=24) for e in (released, kept))
    assert [r.token_ids for r in ours] == [r.token_ids for r in theirs]
    with pytest.raises(RuntimeError, match="keep_model_weights=True"):
        released.target_runner.model(torch.tensor([[1, 2, 3]]))


def test_auto_dtype_is_bfloat16_only_where_a_fast_path_makes_it_exact_and_fast(monkeypatch):
    from specdecode import precision
    from specdecode.runners import select

    def auto_dtype(config, device, runner, quantization):
        where = select.circumstances(config, device, runner)
        return precision.resolve("auto", quantization, where).dtype

    llama = LlamaConfig(num_hidden_layers=1, hidden_size=64, num_attention_heads=4)
    cpu = torch.device("cpu")
    monkeypatch.setattr(select, "cpu_flags", lambda: frozenset({"avx2", "avx512_bf16"}))
    if not quantization.onednn_supports(torch.bfloat16):
        pytest.skip("no oneDNN bfloat16 in this torch build")
    assert auto_dtype(llama, cpu, "auto", None) == torch.bfloat16
    assert auto_dtype(GPT2Config(n_layer=1), cpu, "fast", None) == torch.bfloat16
    assert auto_dtype(llama, cpu, "transformers", None) == torch.float32  # not shown exact there
    assert auto_dtype(llama, cpu, "auto", "nf4") == torch.bfloat16  # 4-bit: bfloat16 compute, rowwise.py
    assert auto_dtype(llama, cpu, "auto", "int8") == torch.float32  # LLM.int8: not shown exact in bfloat16
    assert auto_dtype(llama, torch.device("cuda"), "auto", None) == torch.float32
    gelu = LlamaConfig(num_hidden_layers=1, hidden_size=64, num_attention_heads=4, hidden_act="gelu")
    assert auto_dtype(gelu, cpu, "auto", None) == torch.bfloat16  # transformers' modeling on the fast kernels
    mamba = MambaConfig(num_hidden_layers=1, hidden_size=64)
    assert auto_dtype(mamba, cpu, "auto", None) == torch.float32  # no fast path for it
    monkeypatch.setattr(select, "cpu_flags", lambda: frozenset({"avx2"}))  # bfloat16 emulated: slower
    assert auto_dtype(llama, cpu, "auto", None) == torch.float32


def test_auto_chooses_w8a8_only_where_its_measured_recipe_and_kernels_run(monkeypatch):
    """--dtype auto quantizes to w8a8 where the Llama runner runs the model (its recipe's cost
    measured within the budget) on a CPU with the own int8 kernel; nowhere else, and never
    under a named dtype, a named quantization or for a draft."""
    from specdecode import precision
    from specdecode.runners import select

    def auto(config, runner="auto", dtype="auto", named=None, option=precision.TARGET, device="cpu"):
        return precision.resolve(dtype, named, select.circumstances(config, torch.device(device), runner), option)

    llama = LlamaConfig(num_hidden_layers=1, hidden_size=64, num_attention_heads=4)
    monkeypatch.setattr(select, "own_kernel", lambda: object())  # as where a vectorized build runs
    assert auto(llama).quantization is precision.W8A8 and auto(llama).chosen
    assert auto(llama, runner="fast").quantization is precision.W8A8
    assert auto(llama, dtype="bfloat16").quantization is None  # the checkpoint's own arithmetic
    assert auto(llama, dtype="float32").quantization is None
    assert auto(llama, named="nf4").quantization is precision.NF4
    assert auto(llama, option=precision.DRAFT).quantization is None
    assert auto(llama, runner="transformers").quantization is None
    assert auto(llama, device="cuda").quantization is None
    gelu = LlamaConfig(num_hidden_layers=1, hidden_size=64, num_attention_heads=4, hidden_act="gelu")
    assert auto(gelu).quantization is None  # the generic runner: its plain w8a8 costs more
    monkeypatch.setattr(select, "own_kernel", lambda: None)  # no vectorized build of the int8 kernel
    assert auto(llama).quantization is None


def test_from_pretrained_names_the_precision_auto_chose(tiny_model_dir):
    from specdecode import precision
    from specdecode.runners.projection import own_kernel

    engine = SpeculativeEngine.from_pretrained(tiny_model_dir, drafter="none")
    chosen = str(engine.target_runner.dtype).removeprefix("torch.")
    if own_kernel() is not None:  # w8a8, with its measured cost and the flag that leaves it
        assert engine.quantization is precision.W8A8 and engine.precision.startswith("w8a8")
        assert f"{chosen} elsewhere ({precision.AUTO_W8A8_NOTE})" in engine.precision
    else:
        assert engine.quantization is None and engine.precision == f"{chosen} (--dtype auto)"
    explicit = SpeculativeEngine.from_pretrained(tiny_model_dir, dtype="float32", drafter="none")
    assert explicit.precision == "float32" and explicit.quantization is None


def test_kept_hidden_states_are_transformers_hidden_states():
    """Layer i < L: the hidden state entering decoder layer i (transformers' hidden_states[i]);
    L: the last layer's output before the final norm. Every new row, from the same forward:
    a prefill, a verification, a batch of two."""
    model = head64_llama(0, torch.float32, num_hidden_layers=3)
    ids = torch.randint(0, 256, (15,), generator=torch.Generator().manual_seed(0))
    last = []
    hook = model.model.layers[-1].register_forward_hook(lambda module, args, out: last.append(out))
    with torch.no_grad():
        expected = model(ids[None], output_hidden_states=True).hidden_states
    hook.remove()
    output = last[0][0] if isinstance(last[0], tuple) else last[0]  # [1, 15, hidden]
    wanted = (3, 0, 2)
    reference = torch.stack([output[0] if i == 3 else expected[i][0] for i in wanted], dim=1)  # [15, 3, hidden]
    runner = FastLlamaRunner(model)
    runner.hidden_layers = wanted
    runner.forward(ids[:10], 1)
    prefill = runner.hidden
    runner.forward(ids[10:], 5)
    kept = torch.cat([prefill, runner.hidden])
    assert kept.shape == (15, 3, 256) and kept.dtype == torch.float32
    torch.testing.assert_close(kept, reference, atol=1e-5, rtol=1e-5)
    caches = [runner.new_cache(), runner.new_cache()]
    runner.forward_batch(caches, [ids[:7], ids[:12]], [1, 1])
    assert [h.shape for h in runner.hidden] == [(7, 3, 256), (12, 3, 256)]
    torch.testing.assert_close(runner.hidden[1], reference[:12], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="each in 0..3"):
        runner.hidden_layers = (4,)


def test_hidden_states_are_not_kept_unless_asked_and_change_no_logits():
    runner = FastLlamaRunner(head64_llama(0, torch.bfloat16))
    ids = torch.arange(20, 40)
    assert runner.hidden_layers == ()
    plain = runner.forward(ids, 20)
    assert runner.hidden is None
    runner.reset()
    runner.hidden_layers = (1, 2)
    assert torch.equal(runner.forward(ids, 20), plain)
    assert runner.hidden.shape == (20, 2, 256)
    runner.hidden_layers = ()
    runner.reset()
    runner.forward(ids, 20)
    assert runner.hidden is None
