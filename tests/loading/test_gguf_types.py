"""The .gguf types users download (Q4_K_M, Q5_K_M, Q6_K, Q8_0), made from the default model's file
by llama.cpp's own quantizer: each holds its type's blocks, loads into the fast runner at the
default precision, and decodes exactly (speculative equal to target-only, drafts kept)."""

from __future__ import annotations

import pytest
from gguf import GGUFReader

from helpers import assert_drafted_and_accepted
from specdecode import SpeculativeEngine
from specdecode.bench.llamacpp import GGUF_TYPES, installed, quantized_gguf
from specdecode.loading import OFFLINE_MODELS

pytestmark = pytest.mark.skipif(
    not installed(), reason="llama-cpp-python quantizes: pip install 'specdecode[llamacpp]'"
)
PROMPT = "Repeat exactly: the quick brown fox jumps over the lazy dog. The quick brown fox"


@pytest.mark.parametrize("kind", GGUF_TYPES)
def test_each_type_loads_into_the_fast_path_and_decodes_exactly(kind):
    path = quantized_gguf(OFFLINE_MODELS["smollm2-135m-instruct"].gguf_path(), kind)
    block = kind.removesuffix("_M")  # Q4_K_M holds Q4_K blocks (and others where rows do not divide)
    assert block in {tensor.tensor_type.name for tensor in GGUFReader(path).tensors}
    engine = SpeculativeEngine.from_pretrained(str(path))
    assert type(engine.target_runner).__name__ == "FastLlamaRunner"
    speculative = engine.generate(PROMPT, max_new_tokens=16)[0]
    alone = engine.generate(PROMPT, max_new_tokens=16, speculative=False)[0]
    assert speculative.token_ids == alone.token_ids and speculative.text.strip()
    assert_drafted_and_accepted([speculative], kind)
