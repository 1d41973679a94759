import os

import pytest
import torch

# The tests are CPU tests with small tensors: two threads keep CI timings predictable, or OMP_NUM_THREADS when set
# (make unit-capabilities runs two suites side by side with one thread each).
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or min(2, os.cpu_count() or 1)))


@pytest.fixture
def generator():
    return torch.Generator().manual_seed(1234)
