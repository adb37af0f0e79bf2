"""`specdecode bench`: outputs that parse, exact greedy outputs, clear errors; tiny models, except
the one quick run on the real model (slow)."""

import io
import json
import time
from pathlib import Path

import pytest
import torch
from rich.console import Console
from typer.testing import CliRunner

from helpers import nearby_draft, tiny_llama, tiny_tokenizer
from specdecode.bench import BenchConfig, overall_table, run_benchmark, write_outputs
from specdecode.bench.config import QUICK
from specdecode.bench.costs import ForwardCosts
from specdecode.bench.interleave import Run, best_per_item, interleave, medians
from specdecode.bench.measurement import Measurement
from specdecode.bench.prompts import MT_BENCH_CATEGORIES, default_prompt_file, load_prompts, select_prompts
from specdecode.bench.quality import compare_greedy, first_difference, target_perplexity
from specdecode.bench.scripts import script_parser, write_table
from specdecode.bench.summary import summarize
from specdecode.bench.systems import ENGINE, HF, LLAMACPP, SystemSpec, plan_systems
from specdecode.bench.theory import expected_tokens_per_step, per_token_acceptance, predicted_speedup
from specdecode.cli import app

runner = CliRunner()
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PROMPTS = [
    {"question_id": 1, "category": "repeat", "turns": ["w1 w2 w3 w4 w1 w2 w3 w4 w1 w2", "second turn, not timed"]},
    {"question_id": 2, "category": "repeat", "turns": ["w5 w6 w7 w5 w6 w7"]},
    {"id": "free-1", "category": "free", "prompt": "w9 w3 w12"},
    {"prompt": "w2 w8 w2"},  # no category, no id
]


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(p) for p in PROMPTS) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    """A draft that agrees with the tiny target often, not always."""
    folder = tmp_path_factory.mktemp("tiny-draft")
    nearby_draft(tiny_llama(seed=0), noise=0.3).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def greedy_run(tiny_model_dir, prompt_file, tmp_path_factory):
    """One CLI run with prompt lookup at two k values; its output folder and stdout."""
    folder = tmp_path_factory.mktemp("bench")
    result = runner.invoke(
        app,
        [
            "bench",
            "--target",
            tiny_model_dir,
            "--prompts",
            prompt_file,
            "-k",
            "2,3",
            "--max-new-tokens",
            "12",
            # in float32, transformers' generate's own precision (--dtype auto may choose w8a8)
            "--dtype",
            "float32",
            "--output-dir",
            str(folder),
        ],
    )
    assert result.exit_code == 0, result.output
    return folder, result.stdout


def test_bench_writes_results_report_and_plots(greedy_run):
    folder, stdout = greedy_run
    results = json.loads((folder / "results.json").read_text())
    systems = [s["name"] for s in results["systems"]]
    assert systems == [
        "hf target-only",
        "hf prompt-lookup k=2",
        "hf prompt-lookup k=3",
        "specdecode target-only",
        "specdecode prompt-lookup k=2",
        "specdecode prompt-lookup k=3",
    ]
    assert len(results["measurements"]) == len(PROMPTS) * len(systems)
    assert {p["category"] for p in results["prompts"]} == {"repeat", "free", "custom"}
    environment = results["environment"]
    assert environment["versions"]["torch"] and environment["versions"]["transformers"]
    assert environment["dtype"] == "float32" and environment["torch_threads"] >= 1
    assert set(results["forward_costs"]["target_s"]) == {"1", "3", "4"}  # 1 token, and k + 1 for k = 2, 3
    assert set(results["forward_costs"]["draft_s"]["specdecode prompt-lookup"]) == {"2", "3"}
    assert all(m["new_tokens"] >= 1 and m["wall_time_s"] > 0 for m in results["measurements"])

    report = (folder / "report.md").read_text()
    for heading in (
        "## All categories",
        "## Speedup over (a) by category",
        "## Acceptance by draft position",
        "## Step costs",
        "## Greedy outputs that differ from their reference",
    ):
        assert heading in report
    assert all(name in report for name in systems)
    for plot in ("speedup_by_category", "acceptance_by_position", "tokens_per_second_vs_k"):
        assert (folder / f"{plot}.png").read_bytes().startswith(PNG_SIGNATURE)
        assert f"({plot}.png)" in report
    assert "| (d) | specdecode prompt-lookup k=2 |" in stdout  # the overall table, printed too


def test_every_greedy_output_equals_transformers_greedy_output(greedy_run):
    folder, _ = greedy_run
    results = json.loads((folder / "results.json").read_text())
    assert results["greedy_differences"] == []
    rows = results["summary"]
    assert all(row["greedy_identical"] == 1.0 for row in rows)
    # the engine's own rows are held to it per prompt too, not only on average
    reference = {m["prompt_id"]: m["token_ids"] for m in results["measurements"] if m["group"] == "a"}
    for m in results["measurements"]:
        assert m["token_ids"] == reference[m["prompt_id"]], m["system"]


def test_summary_rows_hold_consistent_metrics(greedy_run):
    folder, _ = greedy_run
    rows = json.loads((folder / "results.json").read_text())["summary"]
    overall = {r["system"]: r for r in rows if r["category"] == "all"}
    assert overall["hf target-only"]["speedup_vs_a"] == pytest.approx(1.0)
    speculative = overall["specdecode prompt-lookup k=3"]
    assert len(speculative["acceptance_by_position"]) == 3
    assert 0.0 <= speculative["acceptance_rate"] <= speculative["alpha"] <= 1.0
    assert speculative["mean_accepted_length"] >= 1.0
    assert speculative["predicted_speedup"] > 0 and speculative["measured_over_predicted"] > 0
    assert speculative["speedup_vs_b"] == pytest.approx(
        speculative["tokens_per_second"] / overall["hf prompt-lookup k=3"]["tokens_per_second"]
    )
    assert speculative["time_per_token_p50_ms"] <= speculative["time_per_token_p90_ms"]
    per_category = [r for r in rows if r["system"] == "specdecode prompt-lookup k=3" and r["category"] != "all"]
    assert sum(r["generations"] for r in per_category) == speculative["generations"] == len(PROMPTS)


def test_draft_model_runs_against_transformers_assisted_generation(tiny_model_dir, prompt_file, draft_dir, tmp_path):
    config = BenchConfig.create(
        target=tiny_model_dir,
        drafts=[draft_dir],
        k_values=[3],
        prompts=prompt_file,
        max_new_tokens=16,
        dtype="float32",  # transformers' assisted generation's precision (--dtype auto may choose w8a8)
        output_dir=str(tmp_path),
    )
    console_output = io.StringIO()
    # a terminal console, so the live progress bar and its ETA really render
    result = run_benchmark(config, Console(file=console_output, force_terminal=True, width=160))
    names = [s["name"] for s in result.systems]
    draft_name = Path(draft_dir).name
    assert f"hf draft {draft_name} k=3" in names and f"specdecode draft {draft_name} k=3" in names
    assert result.differences == []
    overall = {r.system: r for r in result.rows if r.category == "all"}
    model_row = overall[f"specdecode draft {draft_name} k=3"]
    assert model_row.alpha > 0.3  # a nearby draft agrees often
    assert model_row.speedup_vs_b is not None and model_row.predicted_speedup is not None
    hf_options = next(s for s in result.systems if s["name"] == f"hf draft {draft_name} k=3")["generate_options"]
    assert hf_options["num_assistant_tokens"] == 3 and hf_options["num_assistant_tokens_schedule"] == "constant"

    progress = console_output.getvalue()
    total = len(PROMPTS) * len(names)
    assert f"{total}/{total}" in progress and "ETA" in progress

    files = write_outputs(result, tmp_path / "out")
    assert [f.name for f in files][:2] == ["results.json", "report.md"]


def test_sampling_runs_report_perplexity_instead_of_identity(tiny_model_dir, prompt_file, tmp_path):
    config = BenchConfig.create(
        target=tiny_model_dir,
        k_values=[2],
        prompts=prompt_file,
        categories=["repeat"],
        max_new_tokens=10,
        temperature=1.0,
        runs=2,
        output_dir=str(tmp_path),
    )
    result = run_benchmark(config, Console(file=io.StringIO()))
    assert len(result.measurements) == 2 * 2 * 4  # runs x prompts x systems
    for row in result.rows:
        assert row.greedy_identical is None
        assert row.perplexity is not None and row.perplexity >= 1.0
    write_outputs(result, tmp_path)
    assert "| perplexity |" in (tmp_path / "report.md").read_text()


def bench_args(model: str, prompts: str, *extra: str) -> list[str]:
    return ["bench", "--target", model, "--prompts", prompts, "--max-new-tokens", "4", *extra]


@pytest.mark.parametrize(
    "extra,message",
    [
        (["-k", "0"], "-k values must be >= 1"),
        (["-k", "two"], "-k takes whole numbers"),
        (["--drafter", "magic"], "unknown drafter 'magic'"),
        (["--drafter", "model"], "drafter 'model' needs a draft model"),
        (["--system", "vllm"], "unknown system 'vllm' for bench; choose from: llama.cpp, llama.cpp+lookup"),
        (["--system", "llama.cpp", "--temperature", "0.7"], "--system llama.cpp decodes greedily only"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
        (["--runs", "0"], "--runs must be at least 1"),
        (["--temperature", "-1"], "temperature must be >= 0"),
        (["--prompts-per-category", "-1"], "--prompts-per-category must be >= 0"),
        (["--category", "poetry"], "unknown category 'poetry'"),
        (["--prompts", "/no/such/prompts.jsonl"], "does not exist"),
        (["--prompts", "{bad_json}"], "line 2 is not valid JSON"),
        (["--prompts", "{no_prompt}"], "needs a non-empty 'prompt' string"),
        (["--output-dir", "{a_file}"], "is a file; give a folder"),
        (["--target", "./does/not/exist"], "is not a model folder or a .gguf file"),
        (["--device", "tpu"], "unknown device 'tpu'"),
        (["--max-new-tokens", "200"], "no prompt fits the model's context of 128 tokens"),
    ],
)
def test_bad_input_exits_2_with_one_line(tiny_model_dir, prompt_file, tmp_path, extra, message):
    files = {
        "{bad_json}": '{"prompt": "w1"}\n{"prompt": \n',
        "{no_prompt}": '{"category": "x", "turns": []}\n',
        "{a_file}": "not a folder",
    }
    for placeholder, content in files.items():
        (tmp_path / placeholder.strip("{}")).write_text(content)
    extra = [tmp_path / e.strip("{}") if e in files else e for e in extra]
    args = bench_args(tiny_model_dir, prompt_file, "--output-dir", str(tmp_path / "out"), *map(str, extra))
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.output


def test_shipped_subset_has_every_spec_bench_category_and_its_license():
    prompts = load_prompts()  # no path: the subset in the package
    categories = {p.category for p in prompts}
    assert categories == {*MT_BENCH_CATEGORIES, "translation", "summarization", "qa", "math_reasoning", "rag"}
    assert all(sum(p.category == c for p in prompts) == 3 for c in categories)
    data = default_prompt_file().parent
    assert "Apache License" in (data / "LICENSE").read_text()
    assert "Spec-Bench" in (data / "NOTICE").read_text()


def test_prompt_selection_by_category_and_count():
    prompts = load_prompts()
    mt_bench = select_prompts(prompts, ("mt-bench",), per_category=1)
    assert [p.category for p in mt_bench] == list(MT_BENCH_CATEGORIES)
    quick = select_prompts(prompts, QUICK["categories"], QUICK["prompts_per_category"])
    assert [p.category for p in quick] == list(QUICK["categories"])
    assert [p.id for p in select_prompts(prompts, ("qa",), per_category=2)] == ["321", "322"]


def test_llama_cpp_systems_come_last_once_each_and_repeat_on_the_command_line():
    config = BenchConfig.create(systems=["llama.cpp+lookup,llama.cpp", "llama.cpp"], k_values=["2"])
    assert config.systems == ("llama.cpp+lookup", "llama.cpp")
    assert "--system llama.cpp+lookup --system llama.cpp" in config.to_command()
    specs = plan_systems(config.active_drafters, config.drafts, config.k_values, config.systems)
    assert [(s.name, s.group) for s in specs[-2:]] == [
        ("llama.cpp target-only", "e"),
        ("llama.cpp prompt-lookup k=2", "f"),
    ]
    assert [s.group for s in plan_systems(("prompt-lookup",), (), (2,))] == ["a", "b", "c", "d"]


def test_quick_preset_yields_to_given_options():
    config = BenchConfig.create(quick=True, max_new_tokens=40, k_values=["3,1", "3"])
    assert config.max_new_tokens == 40 and config.k_values == (1, 3)
    assert config.categories == QUICK["categories"] and config.runs == 1
    assert "--max-new-tokens 40" in config.to_command() and "-k 1 -k 3" in config.to_command()


def test_leviathan_expected_tokens_and_predicted_speedup():
    assert expected_tokens_per_step(0.0, 4) == 1.0
    assert expected_tokens_per_step(1.0, 4) == 5.0
    assert expected_tokens_per_step(0.5, 2) == pytest.approx(1.75)  # 1 + 0.5 + 0.25
    # free drafts and a verify as cheap as one token: the speedup is the tokens per step
    assert predicted_speedup(0.5, 2, target_one_s=0.1, target_verify_s=0.1, proposal_s=0.0) == pytest.approx(1.75)
    assert predicted_speedup(0.0, 4, 0.1, 0.2, 0.1) == pytest.approx(1 / 3)


def test_alpha_counts_only_tested_draft_positions():
    # two steps of k = 2: one accepted both drafts, one rejected the first (its second was never tested)
    assert per_token_acceptance([2, 2], [1, 1]) == pytest.approx(2 / 3)
    assert per_token_acceptance([], []) is None


def tiny_greedy_output():
    """The tiny target, its tokenizer, a prompt and the target's 6 greedy tokens after it."""
    model, tokenizer = tiny_llama(seed=0), tiny_tokenizer()
    prompt = [3, 4, 5]
    with torch.no_grad():
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, 3:].tolist()
    return model, tokenizer, prompt, expected


def test_a_differing_output_is_explained_by_the_targets_top_two_logits():
    model, tokenizer, prompt, expected = tiny_greedy_output()
    wrong = expected[:2] + [(expected[2] + 1) % 24] + expected[3:]

    def measured(system, group, tokens):
        return Measurement(system, group, "p", "cat", 0, 0, len(prompt), tokens, 0.1, None)

    measurements = [measured("a", "a", expected), measured("d", "d", wrong), measured("c", "c", expected)]
    differences = compare_greedy(measurements, {"p": prompt}, model, tokenizer)
    assert [m.first_difference for m in measurements] == [None, 2, None]
    (difference,) = differences
    assert (difference.position, difference.reference_token, difference.system_token) == (2, expected[2], wrong[2])
    assert difference.top_two[0]["token"] == expected[2]  # (a)'s greedy token is the target's top logit
    assert difference.logit_gap >= 0 and difference.top_two[0]["text"] == tokenizer.decode([expected[2]])


def test_perplexity_prefers_the_targets_own_greedy_text():
    model = tiny_llama(seed=0)
    prompt = [3, 4, 5]
    with torch.no_grad():
        greedy = model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False)[0, 3:].tolist()
    shuffled = [(t * 7 + 5) % 24 for t in greedy]
    assert 1.0 <= target_perplexity(model, prompt, greedy) < target_perplexity(model, prompt, shuffled)
    assert target_perplexity(model, prompt, []) is None


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2, 3], [1, 2]) == 2


@pytest.mark.slow
def test_quick_run_on_the_real_model(tmp_path):
    start = time.perf_counter()
    result = runner.invoke(app, ["bench", "--quick", "--output-dir", str(tmp_path)])
    elapsed = time.perf_counter() - start
    assert result.exit_code == 0, result.output
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["config"]["quick"] is True
    assert len(results["prompts"]) == len(QUICK["categories"])
    # speculation: exact relative to the engine's own target-only run, in any dtype
    speculative = [r for r in results["summary"] if r["group"] == "d"]
    assert speculative and all(r["greedy_identical"] == 1.0 for r in speculative), results["greedy_differences"]
    target_only = [r for r in results["summary"] if r["group"] == "c"]
    # where the engine's target-only runs float32 without quantization (a CPU without the w8a8
    # kernels' default), it is transformers' generate's arithmetic
    if results["environment"]["dtype"] == "float32" and not any(
        r["system"] != "specdecode target-only" for r in target_only
    ):
        assert all(r["greedy_identical"] == 1.0 for r in target_only), results["greedy_differences"]
    assert (tmp_path / "speedup_by_category.png").exists()
    print(f"quick bench: {elapsed:.0f} s")


def test_the_repeat_workload_compares_every_system_with_target_only(tiny_model_dir, tmp_path):
    args = ["bench", "--workload", "repeat", "--target", tiny_model_dir, "--prompts-per-category", "1"]
    args += ["--max-new-tokens", "8", "--dtype", "float32", "--output-dir", str(tmp_path)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    rows = [line for line in result.output.splitlines() if line.startswith("| ") and "| workload |" not in line]
    assert len(rows) == 4 * 4  # every workload, every system
    assert all(row.split("|")[-2].strip() == "1/1" for row in rows)  # each output identical to target-only
    assert (tmp_path / "repeat.md").read_text().strip().endswith(rows[-1])


@pytest.mark.parametrize(
    "args, says",
    [
        (["--workload", "nope"], "unknown --workload 'nope'"),
        (["--workload", "repeat", "-k", "3"], "-k do not apply"),
        (["--workload", "repeat", "--system", "llama.cpp"], "--system do not apply"),
    ],
)
def test_bad_bench_workloads_exit_2_with_one_line(args, says):
    result = CliRunner().invoke(app, ["bench", *args])
    assert result.exit_code == 2 and says in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1


def test_interleave_runs_every_system_on_an_item_before_the_next_one():
    calls = []

    def system(name):
        return lambda item: calls.append((name, item)) or f"{name}{item}"

    systems = {name: system(name) for name in "abc"}
    runs = interleave(systems, [1, 2], repeats=2, order="alternate", warm_up=1)
    assert calls[:3] == [("a", 1), ("b", 1), ("c", 1)]  # the warm-up, untimed
    assert calls[3:] == [(n, i) for i, names in ((1, "abc"), (2, "abc"), (1, "cba"), (2, "cba")) for n in names]
    assert [(r.system, r.item, r.repeat, r.order, r.value) for r in runs[6:9]] == [
        ("c", 0, 1, 0, "c1"),
        ("b", 0, 1, 1, "b1"),
        ("a", 0, 1, 2, "a1"),
    ]
    assert all(r.seconds >= 0 for r in runs)
    shuffled = [[r.system for r in interleave(systems, range(6), order="shuffle", seed=s)] for s in (0, 0, 1)]
    assert shuffled[0] == shuffled[1] != shuffled[2]  # the seed decides the order
    orders = {tuple(shuffled[0][i : i + 3]) for i in range(0, 18, 3)}
    assert all(sorted(o) == ["a", "b", "c"] for o in orders) and len(orders) > 1  # each item: all, in new orders
    with pytest.raises(ValueError, match="order must be one of"):
        interleave(systems, order="random")


def test_medians_and_the_best_run_per_item():
    runs = [
        Run("x", item, repeat, 0, value, seconds)
        for item, repeat, value, seconds in [(0, 0, 5.0, 3.0), (0, 1, 7.0, 1.0), (1, 0, 2.0, 2.0)]
    ]
    runs.append(Run("y", 0, 0, 1, 1.0, 9.0))
    assert medians(runs) == {"x": 2.0, "y": 9.0}
    assert medians(runs, key=lambda r: r.value) == {"x": 5.0, "y": 1.0}
    best = best_per_item(runs, key=lambda r: r.value)
    assert {key: run.value for key, run in best.items()} == {("x", 0): 7.0, ("x", 1): 2.0, ("y", 0): 1.0}


def llama_measurements() -> tuple[list[Measurement], list]:
    """(a), (c), (e) and (f) on two prompts, with llama.cpp's counts for (f): e twice as fast as a."""
    specs = [SystemSpec(HF), SystemSpec(ENGINE), SystemSpec(LLAMACPP), SystemSpec(LLAMACPP, "prompt-lookup", 2)]
    seconds = {"a": 1.0, "c": 0.8, "e": 0.5, "f": 0.4}
    counts = {"generated_tokens": 10, "target_forwards": 4, "drafted_tokens": 12}
    measurements = [
        Measurement(
            s.name, s.group, p, "cat", 0, 0, 3, list(range(10)), seconds[s.group], counts if s.group == "f" else None
        )
        for s in specs
        for p in ("p1", "p2")
    ]
    return measurements, specs


def test_llama_cpp_systems_get_their_columns_in_the_summary_and_the_report():
    measurements, specs = llama_measurements()
    rows = summarize(measurements, specs, ForwardCosts(3), greedy=True)
    overall = {r.group: r for r in rows if r.category == "all"}
    assert overall["e"].speedup_vs_e == pytest.approx(1.0)
    assert overall["a"].speedup_vs_e == pytest.approx(0.5) and overall["f"].speedup_vs_e == pytest.approx(1.25)
    assert overall["f"].speedup_vs_a == pytest.approx(2.5)
    assert overall["f"].mean_accepted_length == pytest.approx(10 / 4)  # llama.cpp's tokens per decode call
    assert overall["e"].mean_accepted_length is None  # one token a forward, said nowhere
    table = overall_table(rows, greedy=True)
    assert "| vs (e) |" in table and "| (f) | llama.cpp prompt-lookup k=2 | 25.0 | 2.50x | – | – | 1.25x |" in table
    without = [r for r in rows if r.group in ("a", "c")]
    assert "vs (e)" not in overall_table(without, greedy=True)  # no llama.cpp, no column


def test_llama_cpp_prompt_lookup_is_held_to_llama_cpp_plain_decoding():
    model, tokenizer, prompt, expected = tiny_greedy_output()
    other = expected[:3] + [(expected[3] + 1) % 24] + expected[4:]  # llama.cpp parts from (a) at a near-tie

    def measured(group, tokens):
        return Measurement(group, group, "p", "cat", 0, 0, len(prompt), tokens, 0.1, None)

    measurements = [measured("a", expected), measured("e", other), measured("f", other), measured("c", expected)]
    differences = compare_greedy(measurements, {"p": prompt}, model, tokenizer)
    assert [m.first_difference for m in measurements] == [None, 3, None, None]  # (f) equals its reference (e)
    assert [d.system for d in differences] == ["e"]
    lookup_off = measured("f", expected)  # (f) that differs from (e), though it equals (a)
    compare_greedy([measurements[0], measurements[1], lookup_off], {"p": prompt}, model, tokenizer)
    assert lookup_off.first_difference == 3


def test_a_script_prints_its_table_and_writes_it_below_its_command_and_machine(tmp_path, monkeypatch, capsys):
    args = script_parser("A script.", max_new_tokens=64, k=4).parse_args(["--max-new-tokens", "5", "-k", "3"])
    assert (args.max_new_tokens, args.k, args.out) == (5, 3, None)
    monkeypatch.setattr("sys.argv", ["/x/benchmarks/demo.py", "--max-new-tokens", "5"])
    write_table("| a |\n|---|", tmp_path / "out" / "demo.md")
    written = (tmp_path / "out" / "demo.md").read_text()
    assert written.startswith("    .venv/bin/python benchmarks/demo.py --max-new-tokens 5\n\n")
    assert "torch threads" in written and written.endswith("| a |\n|---|\n")
    assert capsys.readouterr().out == "| a |\n|---|\n"


def test_the_default_drafter_and_recycling_on_a_w8a8_target_are_held_to_its_own_target_only(
    tiny_model_dir, prompt_file, tmp_path
):
    config = BenchConfig.create(
        target=tiny_model_dir,
        drafters=["auto,recycling"],
        k_values=[4],
        prompts=prompt_file,
        max_new_tokens=12,
        runs=2,
        quantization="w8a8",
        output_dir=str(tmp_path),
    )
    assert "--quantization w8a8" in config.to_command()
    result = run_benchmark(config, Console(file=io.StringIO()))
    names = [s["name"] for s in result.systems]
    # no transformers twin for auto and recycling; the engine's systems name their quantization
    assert names == [
        "hf target-only",
        "specdecode w8a8 target-only",
        "specdecode w8a8 auto k<=4",
        "specdecode w8a8 recycling k=4",
    ]
    assert "w8a8" in result.environment["engine_precision"]
    for row in (r for r in result.rows if r.group == "d"):
        assert row.speedup_vs_c is not None and row.speedup_vs_b is None  # over the w8a8 (c); no twin
    measured = {(m.system, m.prompt_id, m.run): m for m in result.measurements}
    for m in result.measurements:
        if m.group == "d":  # speculation exact relative to the same w8a8 target, prompt by prompt
            assert m.token_ids == measured[("specdecode w8a8 target-only", m.prompt_id, m.run)].token_ids
    recycling = [m for m in result.measurements if m.system == "specdecode w8a8 recycling k=4"]
    assert sum(m.stats["accepted_tokens"] for m in recycling) > 0  # drafts were verified and kept
    # a new table per generation: the second run drafts as the first did, not from its answers
    for m in recycling:
        again = measured[(m.system, m.prompt_id, 1 - m.run)]
        assert m.stats["drafted_per_position"] == again.stats["drafted_per_position"]
        assert m.stats["accepted_per_position"] == again.stats["accepted_per_position"]


def test_a_recycling_table_kept_across_generations_drafts_from_them(tiny_model_dir):
    """The negative control of the test above: one drafter for both runs of a prompt drafts
    otherwise the second time, so equal counts there show the table was new."""
    from specdecode import SpeculativeEngine
    from specdecode.bench.systems import named_drafter

    engine = SpeculativeEngine.from_pretrained(tiny_model_dir, drafter="none", quantization="w8a8")
    kept = engine.with_drafter(named_drafter("recycling", engine)(), 4)
    prompt = engine.encode(PROMPTS[0]["turns"][0])
    first, second = (kept.generate([prompt], max_new_tokens=12)[0].stats for _ in range(2))
    assert first.drafted_per_position != second.drafted_per_position
