"""The .gguf types users download, each made from the target's shipped file by llama.cpp's own
quantizer (requantized: llama.cpp's `allow_requantize`), loaded as the engine loads any .gguf
(its blocks dequantized by transformers' reader) and run at the precision `--dtype auto` picks.

For the shipped file and each of Q4_K_M, Q5_K_M, Q6_K and Q8_0: its size, the blocks it holds
(a tensor whose rows a type's blocks do not divide gets llama.cpp's fallback type, as in the
files users download), the runner and precision the engine picks, and the perplexity of the
first --tokens tokens of docs/design.md (the project's own text) in float32 (the file's own
dequantized weights) and at that precision: the cost of running the file on the fast path.

    .venv/bin/python benchmarks/gguf_types.py [--target smollm2-135m-instruct] [--quantization w8a8]
        [--tokens 1024] [--out FILE]
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch
from gguf import GGUFReader

from specdecode import SpeculativeEngine
from specdecode.bench.llamacpp import GGUF_TYPES, quantized_gguf
from specdecode.bench.quality import chunked_perplexity
from specdecode.bench.scripts import script_parser, write_table
from specdecode.bench.tables import markdown_table
from specdecode.loading import OFFLINE_MODELS
from specdecode.runners.select import runner_label

TEXT = Path(__file__).resolve().parents[1] / "docs" / "design.md"


def blocks(path: Path) -> str:
    counts = Counter(tensor.tensor_type.name for tensor in GGUFReader(path).tensors)
    return ", ".join(f"{name} {count}" for name, count in counts.most_common())


def main() -> None:
    parser = script_parser(__doc__, target="smollm2-135m-instruct")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens of text to score")
    parser.add_argument("--quantization", help="run the files so (w8a8) instead of at what --dtype auto picks")
    args = parser.parse_args()
    source = OFFLINE_MODELS[args.target].gguf_path()
    files = {f"{source.name} (shipped)": source} | {kind: quantized_gguf(source, kind) for kind in GGUF_TYPES}
    rows = []
    for name, path in files.items():
        reference = SpeculativeEngine.from_pretrained(str(path), drafter="none", dtype="float32")
        engine = SpeculativeEngine.from_pretrained(str(path), drafter="none", quantization=args.quantization)
        ids = torch.tensor(engine.tokenizer(TEXT.read_text())["input_ids"][: args.tokens])
        base = chunked_perplexity(reference.target_runner, ids)
        ran = chunked_perplexity(engine.target_runner, ids)
        precision = engine.quantization.name if engine.quantization is not None else engine.precision
        rows.append(
            [
                name,
                f"{path.stat().st_size / 2**20:.0f}",
                blocks(path),
                f"{runner_label(engine.target_runner)}, {precision}",
            ]
            + [f"{base:.3f}", f"{ran:.3f}", f"{(ran / base - 1) * 100:+.2f}%"]
        )
    header = [
        "file",
        "MiB",
        "blocks (tensors)",
        "engine runs it on",
        "perplexity, float32",
        "perplexity, as run",
        "cost",
    ]
    note = (
        f"{args.target}: its shipped .gguf and the types llama.cpp's quantizer makes of it; perplexity of the first "
        f"{args.tokens} tokens of docs/design.md, {torch.get_num_threads()} threads"
    )
    write_table(f"{note}\n\n{markdown_table(header, rows)}", args.out)


if __name__ == "__main__":
    main()
