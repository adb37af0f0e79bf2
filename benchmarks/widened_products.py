"""Half-precision products where oneDNN multiplies float32 only (a CPU without AVX512-BF16 or
AMX for bfloat16): `F.linear` in bfloat16 against the fast path's product on the weight held
widened to float32 (projection.onednn_dtype), for the default model's gate|up shape (3072 x 576),
1, 6 and 16 rows, the two alternated, best of --rounds rounds of 300 calls.

    .venv/bin/python benchmarks/widened_products.py [--rounds 3] [--out FILE]
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from specdecode.bench.scripts import script_parser, write_table
from specdecode.bench.tables import markdown_table
from specdecode.runners import projection

CALLS = 300


def microseconds(product, x: torch.Tensor) -> float:
    for _ in range(20):  # warm
        product(x)
    start = time.perf_counter()
    for _ in range(CALLS):
        product(x)
    return (time.perf_counter() - start) / CALLS * 1e6


def main() -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    weight = torch.randn(3072, 576, generator=torch.Generator().manual_seed(0)).bfloat16()
    product = projection.projection(weight, None, None)
    rows = []
    for n in (1, 6, 16):
        x = torch.randn(n, 576).bfloat16()
        linear, widened = [], []
        for _ in range(args.rounds):  # alternated
            linear.append(microseconds(lambda rows: F.linear(rows, weight), x))
            widened.append(microseconds(product, x))
        rows.append([n, f"{min(linear):.0f}", f"{min(widened):.0f}", f"{min(linear) / min(widened):.2f}x"])
    note = (
        f"the product's weight held as {product.weight.dtype}; oneDNN multiplies bfloat16 here: "
        f"{projection.onednn_supports(torch.bfloat16)}"
    )
    header = ["rows", "F.linear bfloat16 us", "widened oneDNN us", "F.linear / widened"]
    write_table(markdown_table(header, rows) + f"\n\n{note}", args.out)


if __name__ == "__main__":
    main()
