"""Fixtures shared by the engine's tests."""
import pytest
import torch


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    """torch's intra-op threads for one test, 1 and 2 (the demo's), restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread for a module of tiny shapes: on 2 shared cores a second thread costs more in
    synchronisation than it computes. Use as `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
