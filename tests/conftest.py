import os

import pytest
import torch

# The tests are CPU tests with small tensors: two threads keep CI timings predictable.
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture
def generator():
    return torch.Generator().manual_seed(1234)
