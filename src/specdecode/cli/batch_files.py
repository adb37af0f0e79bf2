"""`specdecode batch`: a JSONL file of OpenAI Batch API requests answered offline, as the server
would answer them (server/batch.py; on Ray actors with --ray: server/ray_batch.py)."""

from __future__ import annotations

from typing import Annotated

import typer

from specdecode.cli.console import loading, stderr
from specdecode.cli.errors import user_errors
from specdecode.cli.options import (
    SERVER,
    AdaptiveOption,
    DeviceOption,
    DrafterOption,
    DraftOption,
    DtypeOption,
    KOption,
    QuantizationOption,
    RayAddressOption,
    RayOption,
    ReplicaCpusOption,
    ReplicasOption,
    ShippedHeadOption,
    TargetOption,
    server_config,
)
from specdecode.errors import InvalidArgumentError


def batch(
    input: Annotated[str, typer.Argument(help="JSONL in the OpenAI Batch API format (custom_id, method, url, body).")],
    output: Annotated[str, typer.Option(help="JSONL of answers: a new or empty file, or this input's, to resume.")],
    target: TargetOption = SERVER.target,
    draft: DraftOption = SERVER.draft,
    drafter: DrafterOption = SERVER.drafter,
    k: KOption = SERVER.num_speculative_tokens,
    adaptive: AdaptiveOption = SERVER.adaptive,
    shipped_head: ShippedHeadOption = SERVER.shipped_head,
    concurrency: Annotated[int, typer.Option(help="Requests decoded together (continuous batching).")] = 8,
    device: DeviceOption = SERVER.device,
    dtype: DtypeOption = SERVER.dtype,
    quantization: QuantizationOption = SERVER.quantization,
    ray: RayOption = False,
    ray_address: RayAddressOption = None,
    replicas: ReplicasOption = 1,
    replica_cpus: ReplicaCpusOption = 1.0,
) -> None:
    """Answer a JSONL file of completions and chat requests offline, as `specdecode serve` would."""
    from pathlib import Path

    from specdecode.bench.progress import bench_progress
    from specdecode.server.app import app_from_config
    from specdecode.server.batch import pending, read_requests, run_batch

    with user_errors():
        source, destination = Path(input), Path(output)
        if not source.is_file():
            raise InvalidArgumentError(f"no input file at {input}")
        if concurrency < 1:
            raise InvalidArgumentError(f"--concurrency must be at least 1, got {concurrency}")
        config = server_config(
            target, draft, drafter, k, adaptive, device, dtype, shipped_head=shipped_head, quantization=quantization
        ).with_batch_size(concurrency)
        on_ray = ray or ray_address is not None
        if on_ray:
            from specdecode.server import ray_cluster

            ray_cluster.check_replicas(replicas, replica_cpus)
        lines = read_requests(source)
        # the output is read once (resuming stays linear), and refused if not this input's before the model loads
        todo = pending(lines, destination)
        left = len(todo)
        if on_ray:
            ray_cluster.connect(ray_address)
            ray_cluster.check_fits(replicas, replica_cpus)
            from specdecode.server.ray_batch import run_batch_on_ray

            description = f"{replicas} Ray actors; {len(lines) - left} done before"

            def answer_all(advance):
                return run_batch_on_ray(config, todo, destination, replicas, replica_cpus, advance)
        else:
            with loading(target, draft):
                server_app = app_from_config(config)
            description = f"{len(lines) - left} of {len(lines)} done before"

            def answer_all(advance):
                return run_batch(server_app, todo, destination, concurrency, advance)

        with bench_progress(stderr) as progress:
            task = progress.add_task(description, total=left)
            answered = answer_all(lambda: progress.advance(task))
    stderr.print(f"{answered} answered, {len(lines) - answered} already in {output}")
