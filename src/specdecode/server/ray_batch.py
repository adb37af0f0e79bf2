"""`specdecode batch --ray`: a batch file answered by N engine actors on a Ray cluster.

Each actor builds the server's app from the ServerConfig and answers lines as the in-process
run does (batch.answer), `concurrency` at once, so its continuous batching decodes them
together. The driver hands the lines out round-robin and writes each answer as it arrives
(batch.write_answers: resumable, every line exactly once). An actor that dies is restarted by
Ray and the lines it held are run again there (max_restarts, max_task_retries): answering a
line has no side effect but its answer, so running it twice is harmless, and only the driver
writes.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import ray
from fastapi.testclient import TestClient

from specdecode.server.app import app_from_config
from specdecode.server.batch import answer, write_answers
from specdecode.server.config import ServerConfig
from specdecode.server.ray_cluster import set_threads

ACTOR_PREFIX = "specdecode-batch-"


@ray.remote(max_restarts=-1, max_task_retries=-1)
class BatchActor:
    def __init__(self, config: ServerConfig, cpus: float):
        set_threads(cpus)
        self.client = TestClient(app_from_config(config))
        self.client.__enter__()  # starts the app's engine worker; it ends with the actor

    def answer(self, line: dict) -> dict:
        return answer(self.client, line)


def run_batch_on_ray(
    config: ServerConfig,
    todo: list[dict],
    output: Path,
    replicas: int,
    replica_cpus: float,
    on_done: Callable[[], None] = lambda: None,
) -> int:
    """Answer every line of todo (batch.pending(): those not yet in output) with `replicas`
    actors, appending each answer to output; the number answered."""
    run = uuid.uuid4().hex[:8]
    actors = [
        # named, so that an operator (or a test) can find them: ray.util.list_named_actors()
        BatchActor.options(
            name=f"{ACTOR_PREFIX}{run}-{i}", num_cpus=replica_cpus, max_concurrency=config.max_batch_size
        ).remote(config, replica_cpus)
        for i in range(replicas)
    ]

    def answers(todo: list[dict]) -> Iterator[dict]:
        pending = [actors[i % replicas].answer.remote(line) for i, line in enumerate(todo)]
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            yield ray.get(done[0])

    try:
        return write_answers(todo, output, answers, on_done)
    finally:
        for actor in actors:
            ray.kill(actor)
