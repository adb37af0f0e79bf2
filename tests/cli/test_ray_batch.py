"""`specdecode batch --ray`: a batch file answered by engine actors on a real local Ray cluster,
every line exactly once and as the in-process run answers it, even when an actor is killed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest
from typer.testing import CliRunner

from helpers import free_port, wait_for
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


# --- on one machine, Ray stays on loopback and the tests never join a cluster by accident ---

RAY_SETTINGS = ("RAY_AUTH_MODE", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_ADDRESS", "RAY_AUTH_TOKEN_PATH")


def test_the_test_cluster_is_a_new_one_of_its_own_on_loopback(ray_address):
    from ray._common.utils import get_ray_address_file  # where `ray start` records its cluster

    assert ray_address.startswith("127.0.0.1:"), ray_address
    assert [node["NodeManagerAddress"] for node in ray.nodes()] == ["127.0.0.1"]
    assert ray.cluster_resources()["CPU"] == 2
    record = get_ray_address_file(None)
    if os.path.exists(record):
        with open(record) as f:
            assert f.read().strip() != ray_address, f"the tests joined the cluster recorded in {record}"


def test_a_cluster_recorded_on_the_machine_live_or_stale_is_not_joined_by_the_tests(ray_start_cluster):
    """The fixture above, run in a pytest of its own where `ray start` left a record: of the live
    loopback cluster, then of one long gone (and RAY_ADDRESS naming it)."""
    address, live = ray_start_cluster
    with open(os.path.join(live, "ray", "ray_current_cluster")) as f:
        assert f.read().strip() == address  # the record that an earlier ray.init(num_cpus=2) joined
    stale = tempfile.mkdtemp(prefix="sd-stale-", dir="/tmp")
    os.makedirs(os.path.join(stale, "ray"))
    gone = f"127.0.0.1:{free_port()}"
    with open(os.path.join(stale, "ray", "ray_current_cluster"), "w") as f:
        f.write(gone)
    test = f"{__file__}::test_the_test_cluster_is_a_new_one_of_its_own_on_loopback"
    try:
        for env in ({"TMPDIR": live}, {"TMPDIR": stale, "RAY_ADDRESS": gone}):
            inner = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")} | env
            result = subprocess.run(
                [sys.executable, "-m", "pytest", test, "-q", "-p", "no:randomly", "-p", "no:cacheprovider"],
                env=inner,
                cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),  # the repository
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert result.returncode == 0, f"{env}:\n{result.stdout[-3000:]}"
    finally:
        shutil.rmtree(stale, ignore_errors=True)


def test_the_batch_command_joins_a_loopback_ray_start_cluster(ray_start_cluster, tiny_model_dir, tmp_path):
    """`specdecode batch --ray-address 127.0.0.1:PORT` against `ray start --head --node-ip-address
    127.0.0.1` with token authentication, from a shell that set nothing for Ray but the token
    (as ~/.ray/auth_token would hold it): the command keeps the address on loopback (Ray would
    rewrite it to the machine's network address, where nothing listens) and sends the token."""
    address, _ = ray_start_cluster
    source, on_ray, local = tmp_path / "in.jsonl", tmp_path / "ray.jsonl", tmp_path / "local.jsonl"
    write_input(source, tiny_model_dir, 3)
    assert CliRunner().invoke(cli_app, batch_args(source, local, tiny_model_dir)).exit_code == 0
    shell = {k: v for k, v in os.environ.items() if k not in RAY_SETTINGS and not k.startswith("PYTEST_")}
    assert shell["RAY_AUTH_TOKEN"]  # the session's token: the cluster's (conftest)
    args = batch_args(source, on_ray, tiny_model_dir) + ["--ray-address", address, "--replicas", "1"]
    result = subprocess.run(
        [sys.executable, "-m", "specdecode.cli", *args], env=shell, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert answers(on_ray) == answers(local) and len(answers(on_ray)) == 3


def test_without_an_address_the_command_starts_a_ray_of_its_own_even_where_one_is_recorded(tiny_model_dir, tmp_path):
    """`--ray` alone starts a Ray that ends with the command (the docs' promise), and does not
    join a cluster an earlier `ray start` recorded: here one long gone."""
    stale = tempfile.mkdtemp(prefix="sd-stale-", dir="/tmp")  # short: Ray's socket paths live under it
    os.makedirs(os.path.join(stale, "ray"))
    with open(os.path.join(stale, "ray", "ray_current_cluster"), "w") as f:
        f.write(f"127.0.0.1:{free_port()}")
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_input(source, tiny_model_dir, 2)
    # the session's token stays (a new cluster would write ~/.ray/auth_token without one)
    unset = ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_ADDRESS")
    shell = {k: v for k, v in os.environ.items() if k not in unset and not k.startswith("PYTEST_")}
    args = batch_args(source, output, tiny_model_dir) + ["--ray", "--replicas", "1"]
    try:
        result = subprocess.run(
            [sys.executable, "-m", "specdecode.cli", *args],
            env=shell | {"TMPDIR": stale},
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        shutil.rmtree(stale, ignore_errors=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(answers(output)) == 2
