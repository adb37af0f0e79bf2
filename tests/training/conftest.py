"""The training tests run torch on one thread: an interrupted run and an uninterrupted one, which they compare byte for byte, then compute alike."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
