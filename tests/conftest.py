import os

import pytest
import torch

# The tests are CPU tests with small tensors: two threads keep CI timings predictable, or OMP_NUM_THREADS when set
# (make unit-capabilities runs two suites side by side with one thread each).
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or min(2, os.cpu_count() or 1)))


@pytest.fixture
def generator():
    return torch.Generator().manual_seed(1234)


@pytest.fixture(autouse=True)
def _global_rng_from_a_seed():
    """Each test starts from torch's global RNG seeded with 0 (a network's initial weights, say), whatever ran
    before it or was deselected; the state is restored after. Module- and session-scoped fixtures are set up
    before this one and must seed what they draw themselves. Statistical tests draw from their own generators."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        yield
