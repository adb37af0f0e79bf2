"""Transformers' modeling code on the engine's kernels (runners/fast_transformers.py), for every
architecture listed: transformers' logits, each verified row with its bits alone (chains, trees,
batches; with a negative control), greedy speculation equal to transformers' generate with drafts
kept, w8a8 speculation equal to its own target-only decoding, sampling by G-test. With w8a8, the
architectures of the C decoder's recipes (C_RECIPES) run their layers in C: the same model as the
torch path to float32 rounding, its own bits alone in every kind of forward, on every build."""

import pytest
import torch
import torch.nn.functional as F
import transformers as T

from helpers import (
    ALPHA,
    DIST_VOCAB,
    assert_drafted_and_accepted,
    every_kind_of_forward,
    exact_joint,
    g_test_pvalue,
    hf_greedy,
    same_bits,
    sample_counts,
    verified_differs_from_alone,
)
from helpers.bits import forced_kernel_isa, kernel_isas
from specdecode import SpeculativeEngine
from specdecode.cpu import cpu_flags
from specdecode.drafters import ModelDrafter, PromptLookupDrafter, RecyclingDrafter
from specdecode.kernels import int8_layer
from specdecode.runners import HFModelRunner, projection, runner_for
from specdecode.runners import fast_transformers as generic
from specdecode.runners.fast_llama import FastLlamaRunner
from specdecode.runners.fast_transformers import FastTransformersRunner
from specdecode.runners.projection import Int8Projection
from specdecode.runners.select import runner_label

SHAPE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=None,
    initializer_range=0.3,
)
WINDOW = 8  # sliding windows shorter than the sequences, so that they count
ARCHITECTURES = {
    "llama": (T.LlamaForCausalLM, T.LlamaConfig, {}),
    "mistral": (T.MistralForCausalLM, T.MistralConfig, dict(sliding_window=WINDOW)),
    "qwen2": (T.Qwen2ForCausalLM, T.Qwen2Config, {}),
    "qwen3": (T.Qwen3ForCausalLM, T.Qwen3Config, {}),
    "gemma2": (T.Gemma2ForCausalLM, T.Gemma2Config, dict(sliding_window=WINDOW)),  # soft-capping too
    "gemma3": (
        T.Gemma3ForCausalLM,
        T.Gemma3TextConfig,
        dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]),
    ),
    "phi3": (T.Phi3ForCausalLM, T.Phi3Config, {}),
    "olmo2": (T.Olmo2ForCausalLM, T.Olmo2Config, {}),
    "granite": (T.GraniteForCausalLM, T.GraniteConfig, {}),
    "smollm3": (T.SmolLM3ForCausalLM, T.SmolLM3Config, {}),
    "gpt_neox": (T.GPTNeoXForCausalLM, T.GPTNeoXConfig, dict(num_key_value_heads=4)),  # no grouped queries
}
needs_bf16_cpu = pytest.mark.skipif("avx512_bf16" not in cpu_flags(), reason="measured on CPUs with AVX512-BF16")
C_ARCHITECTURES = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3"]  # C_RECIPES' model types
needs_c_layers = pytest.mark.skipif(
    not projection.int8_supported() or projection.own_kernel() is None or int8_layer.load() is None,
    reason="no own w8a8 product or no gcc here",
)


def tiny(name: str, seed: int = 0, dtype: torch.dtype = torch.float32, **config):
    model_class, config_class, extra = ARCHITECTURES[name]
    torch.manual_seed(seed)
    return model_class(config_class(**(SHAPE | extra | config))).eval().to(dtype)


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_logits_match_transformers_through_rollbacks(name):
    model = tiny(name)
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(ids[None]).logits[0]
    runner = FastTransformersRunner(model)
    assert runner.model is model and runner.decoder is not model.base_model
    runner.forward(ids[:25], 1)
    runner.forward(torch.tensor([3, 4, 5]), 3)  # drafts that are then rejected
    runner.crop(25)
    got = torch.cat([runner.forward(ids[25:30], 5), runner.forward(ids[30:], 10)])
    torch.testing.assert_close(got, expected[25:], atol=1e-5, rtol=1e-5)
    with torch.no_grad():  # the model itself still runs transformers' own attention
        torch.testing.assert_close(model(ids[None]).logits[0], expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ARCHITECTURES)
def test_each_verified_token_gets_its_logits_decoded_alone(name, dtype):
    assert verified_differs_from_alone(FastTransformersRunner(tiny(name, dtype=dtype))) == 0


def batched_sdpa(self, layer, q, k, v, scale, window, softcap):
    """The negative control's attention: each sequence's queries in one batched SDPA call."""
    out = torch.empty(q.shape[2], q.shape[1], q.shape[3], dtype=q.dtype)
    for s in self.sequences:
        keys, values, length = s.cache.keys[layer], s.cache.values[layer], s.cache.length
        keys[:, length : length + s.n] = k[0, :, s.start : s.start + s.n]
        values[:, length : length + s.n] = v[0, :, s.start : s.start + s.n]
        mask = torch.ones(s.n, length + s.n, dtype=torch.bool).tril(diagonal=length)
        attended = F.scaled_dot_product_attention(
            q[0, :, s.start : s.start + s.n], keys[:, : length + s.n], values[:, : length + s.n],
            attn_mask=mask, scale=scale, enable_gqa=True,
        )  # fmt: skip
        out[s.start : s.start + s.n] = attended.transpose(0, 1)
    return out.unsqueeze(0)


@needs_bf16_cpu
def test_batched_attention_would_give_verified_tokens_other_bits(monkeypatch):
    """Negative control of the test above: SDPA over all of a sequence's queries rounds them differently."""
    monkeypatch.setattr(generic._Forward, "attend", batched_sdpa)
    runner = FastTransformersRunner(tiny("llama", dtype=torch.bfloat16, hidden_size=256, head_dim=64))
    assert verified_differs_from_alone(runner) > 0


@pytest.mark.parametrize("name", ["llama", "gemma3", "qwen3"])
def test_batches_give_each_sequence_its_logits_alone(name):
    runner = FastTransformersRunner(tiny(name, dtype=torch.bfloat16))
    generator = torch.Generator().manual_seed(2)
    sequences = [torch.randint(0, 256, (n,), generator=generator) for n in (30, 12, 21, 10)]

    def run(group):
        caches = [runner.new_cache() for _ in group]
        prefills = runner.forward_batch(caches, [s[:-5] for s in group], [1] * len(group))
        verified = runner.forward_batch(caches, [s[-5:] for s in group], [5] * len(group))
        return [torch.cat(pair) for pair in zip(prefills, verified)]

    alone = [run([s])[0] for s in sequences]
    assert all(torch.equal(a, b) for a, b in zip(alone, run(sequences)))


@pytest.mark.parametrize("name", ["gemma3", "gemma2", "mistral", "phi3"])
def test_a_tree_node_gets_the_logits_of_its_path_decoded_alone(name):
    runner = FastTransformersRunner(tiny(name, dtype=torch.bfloat16))
    prefix = torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(3))
    tokens, parents = torch.tensor([7, 9, 11, 13, 15, 17]), torch.tensor([-1, 0, 0, 1, 2, 4])
    runner.forward(prefix, 1)
    tree = runner.forward(tokens, 6, parents)
    for node in range(6):
        path = [node]
        while parents[path[-1]] >= 0:
            path.append(int(parents[path[-1]]))
        runner.crop(20)
        alone = runner.forward(tokens[path[::-1]], len(path))
        assert torch.equal(alone[-1], tree[node]), node
    runner.crop(20)
    runner.forward(tokens, 6, parents)
    runner.keep(20, [0, 2, 4])  # the path 0 -> 2 -> 4, then one more token after it
    after_keep = runner.forward(torch.tensor([5]), 1)
    runner.crop(20)
    runner.forward(tokens[[0, 2, 4]], 3)
    assert torch.equal(runner.forward(torch.tensor([5]), 1), after_keep)


PROMPTS = [[7, 8, 9, 10, 11, 7, 8, 9, 10, 11, 7, 8], [3, 1, 4, 1, 5, 9, 2, 6] * 3]


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_greedy_speculation_equals_transformers_generate(name):
    model = tiny(name, seed=1)
    # a draft of the same weights on transformers' runner: drafts that are verified and mostly kept
    drafter = ModelDrafter(HFModelRunner(model))
    engine = SpeculativeEngine(FastTransformersRunner(model), drafter=drafter, num_speculative_tokens=4)
    results = engine.generate(PROMPTS, max_new_tokens=30)
    assert [r.token_ids for r in results] == [hf_greedy(model, p, 30) for p in PROMPTS]
    assert_drafted_and_accepted(results, name)
    recycling = RecyclingDrafter(256, 8, PromptLookupDrafter(tree=True))
    trees = SpeculativeEngine(FastTransformersRunner(model), drafter=recycling, num_speculative_tokens=4)
    tree_results = trees.generate(PROMPTS, max_new_tokens=30)
    assert [r.token_ids for r in tree_results] == [r.token_ids for r in results]
    assert sum(r.stats.tree_steps for r in tree_results) > 0


@pytest.mark.parametrize("name", ["llama", "gemma3", "qwen3", "phi3", "gemma2"])
def test_w8a8_speculation_reproduces_w8a8_target_only_decoding(name):
    model = tiny(name, seed=1, dtype=torch.bfloat16)
    runner = FastTransformersRunner(model, "w8a8")
    drafter = ModelDrafter(FastTransformersRunner(model, "w8a8"))  # the same 8-bit model: drafts kept
    engine = SpeculativeEngine(runner, drafter=drafter, num_speculative_tokens=4)
    target_only = [r.token_ids for r in engine.generate(PROMPTS, max_new_tokens=30, speculative=False)]
    speculative = engine.generate(PROMPTS, max_new_tokens=30)
    assert [r.token_ids for r in speculative] == target_only
    assert_drafted_and_accepted(speculative, name)
    assert [r.token_ids for r in engine.generate(PROMPTS, max_new_tokens=30, max_batch_size=2)] == target_only
    assert speculative[0].stats.target_precision.startswith("w8a8")
    assert isinstance(runner.products[0], Int8Projection)


def test_sampling_keeps_the_target_s_distribution():
    """G-test against the model's exact law (float64); negative control: another model's law."""
    params = dict(temperature=1.0)
    target = tiny("gemma3", seed=1, vocab_size=DIST_VOCAB, initializer_range=0.2)
    other = tiny("gemma3", seed=2, vocab_size=DIST_VOCAB, initializer_range=0.2)
    draft = ModelDrafter(HFModelRunner(tiny("gemma3", seed=3, vocab_size=DIST_VOCAB, initializer_range=0.2)))
    engine = SpeculativeEngine(FastTransformersRunner(target), drafter=draft, num_speculative_tokens=3)
    counts = sample_counts(engine, 3, params, seed=5)
    assert g_test_pvalue(counts, exact_joint(target, params)) > ALPHA
    assert g_test_pvalue(counts, exact_joint(other, params)) < ALPHA


def test_kept_hidden_states_are_transformers_hidden_states():
    model = tiny(
        "gemma3", num_hidden_layers=3, layer_types=["sliding_attention", "full_attention", "sliding_attention"]
    )
    ids = torch.randint(0, 256, (15,), generator=torch.Generator().manual_seed(0))
    last = []
    hook = model.model.layers[-1].register_forward_hook(lambda module, args, out: last.append(out))
    with torch.no_grad():
        expected = model(ids[None], output_hidden_states=True).hidden_states
    hook.remove()
    output = last[0][0] if isinstance(last[0], tuple) else last[0]
    reference = torch.stack([output[0] if i == 3 else expected[i][0] for i in (3, 0, 2)], dim=1)
    runner = FastTransformersRunner(model)
    runner.hidden_layers = (3, 0, 2)
    runner.forward(ids[:10], 1)
    prefill = runner.hidden
    runner.forward(ids[10:], 5)
    torch.testing.assert_close(torch.cat([prefill, runner.hidden]), reference, atol=1e-5, rtol=1e-5)
    runner.hidden_layers = ()
    runner.forward(ids[:2], 1)
    assert runner.hidden is None


def test_runner_choice_and_what_falls_back():
    assert isinstance(runner_for(tiny("llama")), FastLlamaRunner)  # the hand-written runner stays
    for name in ("gemma3", "qwen3", "mistral", "phi3"):
        assert isinstance(runner_for(tiny(name)), FastTransformersRunner), name
    assert isinstance(runner_for(tiny("gemma3", dtype=torch.bfloat16), quantization="w8a8"), FastTransformersRunner)
    mamba = T.MambaForCausalLM(T.MambaConfig(vocab_size=24, hidden_size=32, num_hidden_layers=1))
    assert generic.unsupported(mamba) is not None
    assert isinstance(runner_for(mamba), HFModelRunner)
    with pytest.raises(ValueError, match="no fast runner runs mamba"):
        runner_for(mamba, "fast")
    assert runner_label(runner_for(tiny("gemma3"))) == "transformers' modeling on the fast kernels"


def test_the_stats_line_names_the_runner():
    engine = SpeculativeEngine(FastTransformersRunner(tiny("qwen3")), drafter=PromptLookupDrafter())
    stats = engine.generate([PROMPTS[0]], max_new_tokens=5)[0].stats
    assert "on transformers' modeling on the fast kernels" in stats.summary()


def c_runner(name: str, dtype: torch.dtype = torch.bfloat16, seed: int = 1, **config) -> FastTransformersRunner:
    runner = FastTransformersRunner(tiny(name, seed, dtype, **config), "w8a8")
    assert runner.layer_kernel == int8_layer.kernel_identity()  # the C layers run
    return runner


def torch_path_runner(model, monkeypatch) -> FastTransformersRunner:
    with monkeypatch.context() as patch:
        patch.setattr(int8_layer, "load", lambda: None)  # as without gcc
        runner = FastTransformersRunner(model, "w8a8")
    assert runner.layer_kernel is None
    return runner


@needs_c_layers
@pytest.mark.parametrize("name", C_ARCHITECTURES)
def test_the_c_layers_are_the_torch_path_s_model_to_rounding(name, monkeypatch):
    """Logits and hidden states of the C decoder against the same runner's torch path in float32
    (the same int8 products; sliding windows, q/k norms, sandwich norms, gelu and soft-capping in
    C): the same model, not bit for bit (the norms' sums and the activations' exp are C's, and a
    difference in the last bit can move an activation's int8 code by one)."""
    c = c_runner(name, torch.float32)
    reference = torch_path_runner(c.model, monkeypatch)
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(4))
    for runner in (c, reference):
        runner.hidden_layers = (0, 1, 2)
    got = [(c.forward(ids[:30], 30), c.hidden), (c.forward(ids[30:], 10), c.hidden)]
    expected = [
        (reference.forward(ids[:30], 30), reference.hidden),
        (reference.forward(ids[30:], 10), reference.hidden),
    ]
    torch.testing.assert_close(got, expected, atol=2e-3, rtol=1e-3)
    assert not all(torch.equal(a, b) for (a, _), (b, _) in zip(got, expected))  # they are the C file's bits


@needs_c_layers
@pytest.mark.parametrize("name", C_ARCHITECTURES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_c_layers_give_each_verified_token_its_logits_decoded_alone(name, dtype):
    assert verified_differs_from_alone(c_runner(name, dtype)) == 0


@needs_c_layers
@pytest.mark.parametrize("name", C_ARCHITECTURES)
def test_c_layers_give_every_kind_of_forward_the_bits_of_its_rows_alone(name):
    """A batch of prefills, then a chain, one token and a tree side by side: each sequence's logits
    and hidden states are those it gets alone."""
    runner = c_runner(name)
    together = every_kind_of_forward(runner, 2)
    prompts, new = [(70, 3), (12, 4), (27, 5)], [(5, 6, None), (1, 7, None), (4, 8, torch.tensor([-1, 0, 0, 1]))]
    for i, ((n, seed), (m, new_seed, parents)) in enumerate(zip(prompts, new)):
        cache = runner.new_cache()
        ids = torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))
        prefill = runner.forward_batch([cache], [ids], [2])[0]
        ids = torch.randint(0, 256, (m,), generator=torch.Generator().manual_seed(new_seed))
        verified = runner.forward_batch([cache], [ids], [m], [parents])[0]
        assert torch.equal(prefill, together[i]) and torch.equal(verified, together[6 + i]), i


@needs_c_layers
@pytest.mark.skipif(len(kernel_isas()) < 2, reason="this CPU runs one build of the kernels")
@pytest.mark.parametrize("name", C_ARCHITECTURES)
def test_every_build_writes_the_c_recipes_bits_of_the_fastest(name):
    """Gemma's norms and gelu, q/k norms, sliding windows and soft-capping: the same float
    operations in the same order on every build of the C layers."""
    fastest, *others = kernel_isas()
    with forced_kernel_isa(fastest):
        expected = every_kind_of_forward(c_runner(name), 2)
    for isa in others:
        with forced_kernel_isa(isa):
            runner = c_runner(name)
            assert runner._c_layers._kernel.isa == isa
            assert all(same_bits(a, b) for a, b in zip(every_kind_of_forward(runner, 2), expected, strict=True)), isa


def test_architectures_outside_the_c_recipes_run_w8a8_on_the_torch_path():
    runner = FastTransformersRunner(tiny("phi3", dtype=torch.bfloat16), "w8a8")
    assert runner.layer_kernel is None and runner._c_layers is None
