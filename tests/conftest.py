"""Fixtures; the helpers the test files share are in helpers.py."""

from __future__ import annotations

import os

import pytest
import torch

from helpers import tiny_llama, tiny_tokenizer


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A saved tiny Llama with a tokenizer: a local model folder, as a user would give."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama(seed=0).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def ray_address():
    """A real local Ray cluster of this machine's 2 CPUs, started once for the test session
    (in the xdist worker that runs the `ray` group) and stopped at its end; the address that
    `--ray-address` takes. The test process is its driver, so tests can use Ray's own API."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)  # two workers share the two cores; tiny models gain nothing from more
