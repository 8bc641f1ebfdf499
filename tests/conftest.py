import os
import signal
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")          # tests never reach a hub
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _no_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return True
    return not torch.cuda.is_available()


# Without a GPU the Triton kernels run through Triton's interpreter on CPU tensors (the engine's GPU-path
# tests). Triton reads this when a kernel is decorated, i.e. when its module is first imported, so it is set
# here, before any test module imports the engine, not in the test files that need it.
if _no_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# A suite started in the background by a shell without job control inherits SIGINT ignored, and so
# would every child it spawns: the Ctrl-C tests (convert, fetch, up) would interrupt nothing. Take
# the signal back so children start with its default disposition, as under a terminal or CI.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """Factory: tiny_checkpoint(arch, **kw) -> Path; cached per (arch, kw) for the session."""
    from tests.fixtures.tiny_models import make_tiny_checkpoint
    cache: dict = {}

    def make(arch: str, **kw) -> Path:
        key = (arch, tuple(sorted(kw.items())))
        if key not in cache:
            cache[key] = make_tiny_checkpoint(arch, tmp_path_factory.mktemp(arch), **kw)
        return cache[key]
    return make
