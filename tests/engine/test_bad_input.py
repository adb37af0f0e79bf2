"""Bad input raises a SpecDecodeError (a ValueError) that says what to fix."""

import pytest

from helpers import tiny_llama, tiny_tokenizer
from specdecode import (
    InvalidArgumentError,
    ModelNotFoundError,
    PromptTooLongError,
    SpecDecodeError,
    SpeculativeEngine,
    VocabularyMismatchError,
)
from specdecode.drafters import PromptLookupDrafter


@pytest.fixture(scope="module")
def engine():
    return SpeculativeEngine(tiny_llama(seed=1, max_positions=32), tiny_tokenizer(), PromptLookupDrafter())


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(prompts=""), "prompt is empty"),
        (dict(prompts="   "), "prompt is empty"),
        (dict(prompts=[]), "no prompts"),
        (dict(prompts=[[]]), "empty"),
        (dict(prompts=[[1, 99]]), "token ids must be in"),
        (dict(prompts="w1 w2", max_new_tokens=0), "max_new_tokens must be at least 1"),
        (dict(prompts="w1 w2", max_new_tokens=-3), "max_new_tokens must be at least 1"),
        (dict(prompts="w1 w2", temperature=-0.5), "temperature must be >= 0"),
        (dict(prompts="w1 w2", temperature=float("nan")), "temperature must be >= 0"),
        (dict(prompts="w1 w2", temperature=float("inf")), "temperature must be >= 0"),
        (dict(prompts="w1 w2", top_p=0.0), "top_p must be in (0, 1]"),
        (dict(prompts="w1 w2", top_p=1.5), "top_p must be in (0, 1]"),
        (dict(prompts="w1 w2", top_k=0), "top_k must be a positive integer"),
        (dict(prompts=" ".join(["w3"] * 40)), "the prompt has 40 tokens but the model's context holds 32"),
        (dict(prompts="w1 w2", stop=[""]), "stop strings must not be empty"),
        (dict(prompts="w1 w2", stop=["w1", "w2", "w3", "w4", "w5"]), "at most 4 stop strings, got 5"),
        (dict(prompts="w1 w2", stop="w" * 1025), "at most 1024 characters, got one of 1025"),
    ],
)
def test_bad_generation_arguments(engine, kwargs, message):
    with pytest.raises(SpecDecodeError, match=None) as error:
        engine.generate(**kwargs)
    assert isinstance(error.value, ValueError)
    assert message in str(error.value)


@pytest.mark.parametrize(
    "stop",
    [["a"] * 5, ["a", "b", "c", "d", "e", "f"], "x" * 1025, ["ok", "y" * 250_000], ["z" * 250_000] * 4],
    ids=["5 strings", "6 strings", "1025 characters", "250 KB", "4 x 250 KB"],
)
def test_stop_strings_are_bounded_in_number_and_length(engine, stop):
    with pytest.raises(InvalidArgumentError) as error:
        engine.settings(max_new_tokens=16, stop=stop)
    assert error.value.param == "stop"
    # at the bounds they are accepted
    engine.settings(max_new_tokens=16, stop=["a", "b", "c", "x" * 1024])


def test_prompt_over_the_context_is_its_own_error(engine):
    with pytest.raises(PromptTooLongError):
        engine.generate(" ".join(["w3"] * 40))


def test_negative_k():
    with pytest.raises(InvalidArgumentError, match="must be (an integer )?>= 0"):
        SpeculativeEngine(tiny_llama(seed=1), num_speculative_tokens=-1)


def test_unknown_model_name_and_missing_path(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError, match="could not load model 'no-such-model'"):
        SpeculativeEngine.from_pretrained("no-such-model")
    with pytest.raises(ModelNotFoundError, match="is not a model folder or a .gguf file"):
        SpeculativeEngine.from_pretrained("./no/such/folder")


def test_unknown_drafter_and_model_drafter_without_draft():
    with pytest.raises(InvalidArgumentError, match="unknown drafter 'magic'"):
        SpeculativeEngine.from_pretrained("x", drafter="magic")
    with pytest.raises(InvalidArgumentError, match="needs a draft model"):
        SpeculativeEngine.from_pretrained("x", drafter="model")


def test_draft_with_another_vocabulary_is_refused(tiny_model_dir, tmp_path):
    other = tmp_path / "other"
    tiny_llama(seed=2, vocab_size=30).save_pretrained(other)
    tiny_tokenizer(vocab_size=30).save_pretrained(other)
    with pytest.raises(VocabularyMismatchError, match=r"different vocabulary sizes \(30 vs 24"):
        SpeculativeEngine.from_pretrained(tiny_model_dir, draft=str(other), device="cpu")


def test_draft_with_same_size_but_different_tokens_is_refused(tiny_model_dir, tmp_path):
    other = tmp_path / "renamed"
    tiny_llama(seed=2).save_pretrained(other)
    tokenizer = tiny_tokenizer()
    tokenizer.add_tokens(["extra"])  # a 25th token the target does not have
    tokenizer.save_pretrained(other)
    with pytest.raises(VocabularyMismatchError, match="tokenizers differ on 1 tokens"):
        SpeculativeEngine.from_pretrained(tiny_model_dir, draft=str(other), device="cpu")


def test_cuda_without_a_gpu(tiny_model_dir):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(InvalidArgumentError, match="no CUDA GPU is available"):
        SpeculativeEngine.from_pretrained(tiny_model_dir, device="cuda")
