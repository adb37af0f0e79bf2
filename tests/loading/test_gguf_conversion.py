"""The .gguf conversion cache: one folder per file content, safe when two processes convert at once."""

import torch

from helpers import tiny_llama, tiny_tokenizer
from specdecode import loading as models
from specdecode import precision


def test_the_same_file_in_two_places_maps_to_one_converted_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    data = bytes(range(256)) * 20000
    first, second = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf"
    for path in (first, second):
        path.parent.mkdir()
        path.write_bytes(data)
    assert models._fingerprint(first) == models._fingerprint(second)
    second.write_bytes(data[:-1] + b"x")
    assert models._fingerprint(first) != models._fingerprint(second)


def test_files_that_differ_only_between_their_first_and_last_mib_map_to_different_folders(tmp_path, monkeypatch):
    """Two fine-tunes of one model: same size, same header and same tail, other weights."""
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    mib = 1 << 20
    data = bytearray(bytes(range(256)) * (3 * mib // 256))
    first, second = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf"
    first.parent.mkdir()
    first.write_bytes(data)
    data[len(data) // 2] ^= 0xFF  # one byte of the middle MiB
    second.parent.mkdir()
    second.write_bytes(data)
    assert first.stat().st_size == second.stat().st_size
    assert models._fingerprint(first) != models._fingerprint(second)


def gguf_loaded_model():
    model = tiny_llama(seed=0)
    model.config.quantization_config = {"quant_method": "gguf"}  # as transformers' gguf loader leaves it
    return model


def test_a_conversion_that_loses_the_race_keeps_the_winners_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(models.AutoTokenizer, "from_pretrained", lambda *a, **k: tiny_tokenizer())
    monkeypatch.setattr(models.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: gguf_loaded_model())
    folder = tmp_path / "converted" / "m-123"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")  # another process finished first
    (folder / "model.safetensors").write_text("theirs")
    models._convert_gguf(tmp_path / "m.gguf", folder)
    assert (folder / "model.safetensors").read_text() == "theirs"
    assert [p.name for p in folder.parent.iterdir()] == ["m-123"]  # our staging folder is gone


def test_auto_precision_is_float32_on_cuda_until_half_precision_is_shown_exact_there():
    """On CUDA nothing yet shows that a verified row gets the bits of decoding it alone in half
    precision (benchmarks/gpu_exactness.py checks it), so `auto` keeps the exact float32."""

    def resolve_dtype(dtype, device):  # as load_model resolves a model loaded alone
        return precision.resolve(dtype, None, precision.Circumstances(device)).dtype

    assert resolve_dtype("auto", torch.device("cuda")) == torch.float32
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("bfloat16", torch.device("cuda")) == torch.bfloat16
