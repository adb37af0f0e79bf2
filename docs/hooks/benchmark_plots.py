"""MkDocs hook: serve the plots under benchmarks/results/ as results/<path> in the site.

The plots have one home, the benchmark's output folder; a page embeds one as
`results/specbench-10x3/speedup_by_category.png`. mkdocs checks those links like any other.
"""

from pathlib import Path

from mkdocs.structure.files import File

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def on_files(files, config):
    for plot in sorted(RESULTS.rglob("*.png")):
        uri = "results/" + plot.relative_to(RESULTS).as_posix()
        files.append(File.generated(config, uri, abs_src_path=str(plot)))
    return files
