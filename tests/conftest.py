"""Tiny, randomly initialised models built from configs: fast, deterministic, offline."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

VOCAB = 24
WORDS = ["<eos>", "<unk>"] + [f"w{i}" for i in range(VOCAB - 2)]


def tiny_llama(seed: int, vocab_size: int = VOCAB, max_positions: int = 128, init: float = 0.6) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        initializer_range=init,  # large weights give peaked, dissimilar distributions
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).eval()


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


def nearby_draft(target, noise: float, seed: int = 0):
    """A copy of target whose output head is perturbed: a draft that agrees often, not always."""
    draft = copy.deepcopy(target)
    generator = torch.Generator().manual_seed(seed)
    head = draft.get_output_embeddings().weight
    with torch.no_grad():
        head.add_(torch.randn(head.shape, generator=generator) * head.std() * noise)
    return draft


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A saved tiny Llama with a tokenizer: a local model folder, as a user would give."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama(seed=0).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return str(folder)


if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)  # two workers share the two cores; tiny models gain nothing from more


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
