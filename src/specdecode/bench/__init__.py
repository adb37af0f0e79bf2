"""`specdecode bench`: Spec-Bench-style measurements of this engine next to transformers.

config (what to run) -> prompts -> systems (what is compared) -> runner (warm-up, shuffled
timing, progress) -> costs and theory (predicted speedup) -> quality (greedy identity,
perplexity) -> metrics (tables' numbers) -> report and plots (results.json, report.md, PNGs).
"""

from specdecode.bench.config import BenchConfig
from specdecode.bench.harness import BenchResult, run_benchmark
from specdecode.bench.report import overall_table, write_outputs

__all__ = ["BenchConfig", "BenchResult", "overall_table", "run_benchmark", "write_outputs"]
