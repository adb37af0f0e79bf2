"""`specdecode batch --ray`: a batch file answered by engine actors on a real local Ray cluster,
every line exactly once and as the in-process run answers it, even when an actor is killed."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from helpers import wait_for
from specdecode.cli import app as cli_app
from specdecode.server.ray_batch import ACTOR_PREFIX

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.xdist_group("ray")  # one worker holds the one test cluster


def write_input(path, model: str, count: int) -> None:
    lines = [
        {
            "custom_id": f"r{i}",
            "method": "POST",
            "url": "/v1/completions" if i % 3 else "/v1/chat/completions",
            "body": {"model": model, "max_tokens": 100, "temperature": 0}
            | (
                {"prompt": f"w{i % 9 + 1} w2 w3 w{i % 5 + 1} w2"}
                if i % 3
                else {"messages": [{"role": "user", "content": f"w{i % 7 + 1} w3"}]}
            ),
        }
        for i in range(count)
    ]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")


def batch_args(source, output, model: str) -> list[str]:
    return ["batch", str(source), "--output", str(output), "--target", model, "--concurrency", "4"]


def answers(path) -> dict[str, tuple]:
    """custom_id -> what a rerun must reproduce: status, texts, usage (ids and timings differ)."""
    found = {}
    for record in map(json.loads, path.read_text().splitlines()):
        assert record["custom_id"] not in found, f"{record['custom_id']} answered twice"
        body = record["response"]["body"]
        texts = [c["text"] if "text" in c else c["message"]["content"] for c in body["choices"]]
        found[record["custom_id"]] = (record["response"]["status_code"], texts, body["usage"])
    return found


def test_a_killed_actor_loses_no_line_and_the_answers_equal_the_in_process_run(ray_address, tiny_model_dir, tmp_path):
    source, on_ray, local = tmp_path / "in.jsonl", tmp_path / "ray.jsonl", tmp_path / "local.jsonl"
    write_input(source, tiny_model_dir, 48)
    assert CliRunner().invoke(cli_app, batch_args(source, local, tiny_model_dir)).exit_code == 0
    args = batch_args(source, on_ray, tiny_model_dir) + ["--ray-address", ray_address, "--replicas", "2"]
    process = subprocess.Popen([sys.executable, "-m", "specdecode.cli", *args], stderr=subprocess.PIPE, text=True)

    def written() -> int:
        return len(on_ray.read_text().splitlines()) if on_ray.exists() else 0

    wait_for(lambda: written() >= 2 or process.poll() is not None, timeout=180)
    named = ray.util.list_named_actors(all_namespaces=True)
    actors = sorted((a["name"], a["namespace"]) for a in named if a["name"].startswith(ACTOR_PREFIX))
    assert len(actors) == 2 and process.poll() is None
    ray.kill(ray.get_actor(*actors[0]), no_restart=False)
    killed_with = written()
    assert process.wait(300) == 0, process.stderr.read()
    assert killed_with < 48, "the run ended before the kill: give it more lines"
    assert answers(on_ray) == answers(local)
    assert len(answers(on_ray)) == 48


def bad(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specdecode.cli", *args], capture_output=True, text=True, timeout=120)


def test_an_unreachable_ray_address_exits_2_with_one_line(tiny_model_dir, tmp_path):
    for command in (
        ["serve", "--target", tiny_model_dir],
        batch_args(tmp_path / "in.jsonl", tmp_path / "o", tiny_model_dir),
    ):
        write_input(tmp_path / "in.jsonl", tiny_model_dir, 1)
        result = bad([*command, "--ray-address", "127.0.0.1:1"])
        assert result.returncode == 2, result.stderr
        assert "no Ray cluster answers at 127.0.0.1:1" in result.stderr and "Traceback" not in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1


def test_impossible_replica_counts_are_refused_before_anything_starts(ray_address, tiny_model_dir):
    zero = CliRunner().invoke(cli_app, ["serve", "--ray", "--replicas", "0", "--target", tiny_model_dir])
    assert zero.exit_code == 2 and "--replicas must be at least 1" in zero.output
    outside = CliRunner().invoke(cli_app, ["serve", "--ray", "--replicas", "1", "--min-replicas", "3"])
    assert outside.exit_code == 2 and "must lie between --min-replicas 3" in outside.output
    too_many = bad(["serve", "--ray-address", ray_address, "--replicas", "3", "--target", tiny_model_dir])
    assert too_many.returncode == 2, too_many.stderr
    assert "needs 3 CPUs; the Ray cluster has 2" in too_many.stderr and "Traceback" not in too_many.stderr
