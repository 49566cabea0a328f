import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Tiny models: a second thread only adds synchronisation, and on a loaded machine the
    oversubscribed OpenMP threads make a step many times slower. Module scope: set before
    the module-scoped model fixtures, restored after the module."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
