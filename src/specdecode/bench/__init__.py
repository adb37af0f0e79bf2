"""`specdecode bench` and the shared pieces of every benchmark in benchmarks/.

The bench: config (what to run) -> prompts -> systems (what is compared) -> harness (warm-up,
systems interleaved in a shuffled order per prompt, progress) -> costs and theory (predicted
speedup) -> quality (greedy identity, perplexity) -> summary (the tables' numbers) -> outputs
and plots (results.json, report.md, PNGs).

Shared with the scripts in benchmarks/: interleave (systems side by side, medians or the best),
environment (the machine a number was measured on), tables (Markdown), scripts (their flags and
where their tables go), prompts and quality. The load test lives beside the server
(specdecode.server.loadtest), the profiler beside the runners (specdecode.runners.profiling).
"""

from specdecode.bench.config import BenchConfig
from specdecode.bench.harness import BenchResult, run_benchmark
from specdecode.bench.outputs import overall_table, write_outputs

__all__ = ["BenchConfig", "BenchResult", "overall_table", "run_benchmark", "write_outputs"]
