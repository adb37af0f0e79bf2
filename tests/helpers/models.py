"""Tiny models built from configs (fast, deterministic, offline), their tokenizer, and the
references greedy tests compare against: transformers' own greedy generate."""

from __future__ import annotations

import copy

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

VOCAB = 24
WORDS = ["<eos>", "<unk>"] + [f"w{i}" for i in range(VOCAB - 2)]


# the shape every tiny Llama-family model shares: fast, and big enough for GQA and rope
TINY_SHAPE = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def tiny_causal_lm(model_class, config_class, seed: int, **config):
    """A randomly initialised model of TINY_SHAPE (config overrides it), in eval mode."""
    torch.manual_seed(seed)
    return model_class(config_class(**(dict(vocab_size=VOCAB) | TINY_SHAPE | config))).eval()


def tiny_llama(seed: int, vocab_size: int = VOCAB, max_positions: int = 128, init: float = 0.6) -> LlamaForCausalLM:
    return tiny_causal_lm(
        LlamaForCausalLM,
        LlamaConfig,
        seed,
        vocab_size=vocab_size,
        max_position_embeddings=max_positions,
        initializer_range=init,  # large weights give peaked, dissimilar distributions
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )


def head64_llama(
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    vocab_size: int = 256,
    kv_heads: int = 2,
    tie_word_embeddings: bool = False,
    **config,
) -> LlamaForCausalLM:
    """hidden 256, head_dim 64: the default model's head size (which the fast runner's tree
    attention kernel takes), with no special tokens, so nothing ends a generation early."""
    torch.manual_seed(seed)
    shape = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4)
    special = dict(eos_token_id=None, bos_token_id=None, pad_token_id=None)
    llama = LlamaConfig(
        vocab_size=vocab_size,
        num_key_value_heads=kv_heads,
        max_position_embeddings=512,
        tie_word_embeddings=tie_word_embeddings,
        **(shape | special | config),
    )
    return LlamaForCausalLM(llama).eval().to(dtype)


def tiny_gpt2(seed: int, vocab_size: int = VOCAB, max_positions: int = 128, init: float = 0.6) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=vocab_size,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=max_positions,
        initializer_range=init,
        eos_token_id=None,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    return GPT2LMHeadModel(config).eval()


def tiny_tokenizer(vocab_size: int = VOCAB) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over 'w0 w1 ...', so text prompts work offline."""
    words = WORDS[:2] + [f"w{i}" for i in range(vocab_size - 2)]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", unk_token="<unk>")


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE without merges: one token a byte, so that any text (JSON, say) is a token
    sequence; "<eos>" the last id."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)} | {"<eos>": len(alphabet)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>")


def byte_llama(seed: int = 0, max_positions: int = 256):
    """A tiny Llama over byte_tokenizer's vocabulary (which llguidance reads, for grammars), its
    EOS the tokenizer's; (model, tokenizer)."""
    tokenizer = byte_tokenizer()
    target = tiny_llama(seed=seed, vocab_size=len(tokenizer), max_positions=max_positions)
    target.generation_config.eos_token_id = tokenizer.eos_token_id
    return target, tokenizer


def nearby_draft(target, noise: float, seed: int = 0):
    """A copy of target whose output head is perturbed: a draft that agrees often, not always."""
    draft = copy.deepcopy(target)
    generator = torch.Generator().manual_seed(seed)
    head = draft.get_output_embeddings().weight
    with torch.no_grad():
        head.add_(torch.randn(head.shape, generator=generator) * head.std() * noise)
    return draft


def permuted_vocabulary(model, seed: int = 0):
    """The same model and words under another tokenizer: ids permuted, embeddings and head rows too.

    Drafting for `model` through text, it proposes exactly what model would: a cross-tokenizer
    drafter with perfect agreement, built offline."""
    vocab_size = model.get_input_embeddings().weight.shape[0]
    perm = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(seed))  # old id -> new id
    words = WORDS[:2] + [f"w{i}" for i in range(vocab_size - 2)]
    backend = Tokenizer(models.WordLevel({w: int(perm[i]) for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", unk_token="<unk>")
    permuted = copy.deepcopy(model)
    with torch.no_grad():
        for weight in (permuted.get_input_embeddings().weight, permuted.get_output_embeddings().weight):
            weight[perm] = weight.clone()
    return permuted, tokenizer


GREEDY_PROMPTS = [[3, 5, 7, 2], [1, 1, 4, 9, 16, 9, 4], [20, 3, 20, 3, 20]]  # token ids, for the greedy tests


def hf_greedy(model, prompt, max_new_tokens):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def assert_drafted_and_accepted(results, name=None):
    """Equality proves nothing about speculation unless drafts were verified and some kept."""
    assert sum(r.stats.drafted_tokens for r in results) > 0, name
    assert sum(r.stats.accepted_tokens for r in results) > 0, name


def adapting_on_acceptance(engine, monkeypatch) -> list[int]:
    """Make the engine's adaptive k follow acceptance alone, whatever the machine's speed:
    verification costs frozen at synthetic values that rise steeply past 3 tokens, drafting
    at 2 ms a token. Returns the list that collects every k the policy chooses, so that a
    test can check that k really adapted."""
    from specdecode.core.adaptive import AdaptiveK

    engine.decoder.costs.seconds = {1: 0.010, 2: 0.011, 3: 0.012, 4: 0.030, 5: 0.032, 6: 0.034}
    monkeypatch.setattr(engine.decoder.costs, "record", lambda n, seconds: None)
    monkeypatch.setattr(
        AdaptiveK, "record_draft", lambda self, n, seconds: setattr(self, "draft_seconds_per_token", 0.002)
    )
    chosen: list[int] = []
    choose = AdaptiveK.choose

    def spy(self, k_max, batch_size=1):
        chosen.append(choose(self, k_max, batch_size))
        return chosen[-1]

    monkeypatch.setattr(AdaptiveK, "choose", spy)
    return chosen


def bnb_llama(seed: int, vocab_size: int = VOCAB, init: float = 0.3) -> LlamaForCausalLM:
    """A tiny Llama that bitsandbytes can quantize: its CPU 4-bit layout needs every output size
    a multiple of 32 (tiny_llama's key/value projections have 16 outputs)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        initializer_range=init,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).eval()


def verified_differs_from_alone(runner, n: int = 6, starts=range(10, 290, 20), length: int = 300) -> int:
    """How many verification forwards of n tokens (one after each of `starts` cached tokens of a
    fixed random sequence of `length`) give logits not bitwise equal to decoding their tokens
    one at a time."""
    tokens = torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(1))
    differ = 0
    for start in starts:
        runner.reset()
        runner.forward(tokens[:start], 1)
        together = runner.forward(tokens[start : start + n], n)
        runner.crop(start)
        alone = torch.cat([runner.forward(tokens[start + j : start + j + 1], 1) for j in range(n)])
        differ += not torch.equal(together, alone)
    return differ
