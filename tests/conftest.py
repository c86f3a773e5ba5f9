"""Shared test helpers. Every test draws fresh random inputs from a seeded generator.

The suite runs one worker process per core (pytest-xdist, ``-n auto`` in pyproject.toml) without a
GPU, and in one process with a GPU, whose tests share the device. A worker's torch and BLAS use
one thread, so two workers on two cores do not contend; `-n 0` runs everything in this process.
Markers: ``gpu`` (skipped without CUDA), ``slow`` (longer than a few seconds on 2 CPU cores;
``-m "not slow"`` leaves them out for a quick check).
"""
import os

if os.environ.get("PYTEST_XDIST_WORKER"):
    for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(_var, "1")

import pytest  # noqa: E402  (after the thread counts are set)
import torch  # noqa: E402

# Without a GPU, the Triton kernels run in Triton's CPU interpreter; Triton reads this variable
# when the kernels are defined, so it must be set before stableflash.attention.triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto``: one worker per core this process may use without a GPU; none with one."""
    if torch.cuda.is_available():
        return 0
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` skip cleanly without a CUDA device. Tests marked ``slow`` run first, in
    their collected order: under ``-n auto`` they start while most of the run is still ahead, and the
    run ends on short tests instead of one worker finishing a long test while the other waits."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


def readme_python_blocks() -> list[str]:
    """The README's ```python blocks, in order (tests run them as a user would copy them)."""
    import re
    from pathlib import Path
    readme = Path(__file__).resolve().parents[1] / "README.md"
    return re.findall(r"```python\n(.+?)```", readme.read_text(), flags=re.S)


def rel_err(actual: torch.Tensor, expected: torch.Tensor, floor: float = 0.0) -> float:
    """max |actual − expected| / max(max |expected|, floor), in float64.

    ``floor`` is for references that vanish in exact arithmetic (dQ and dK of a one-token
    sequence): then the error is measured against the inputs' natural scale instead.
    """
    a, e = actual.double(), expected.double()
    denom = max(e.abs().max().item(), floor)
    return (a - e).abs().max().item() / (denom if denom > 0 else 1.0)


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """Token files of the first 2 MB of the embedded corpus, prepared once for the whole run."""
    from stableflash.train import corpus
    out = tmp_path_factory.mktemp("corpus")
    corpus.prepare_embedded(out, max_bytes=2_000_000)
    return out


@pytest.fixture
def gen(request) -> torch.Generator:
    """A generator seeded from the test's name, so each test has its own reproducible draw."""
    seed = sum(map(ord, request.node.name)) * 7919 % (2**31)
    return torch.Generator().manual_seed(seed)


def qkv(gen, b, h, n, d, n_k=None, dtype=torch.float32, scale=1.0):
    n_k = n if n_k is None else n_k
    q = torch.randn(b, h, n, d, generator=gen) * scale
    k = torch.randn(b, h, n_k, d, generator=gen) * scale
    v = torch.randn(b, h, n_k, d, generator=gen)
    return q.to(dtype), k.to(dtype), v.to(dtype)


@pytest.fixture
def ctrl_c():
    """SIGINT raises KeyboardInterrupt in this test, as under a terminal: a process started in the
    background (a CI step, `cmd &`) inherits SIGINT ignored, and the training loop leaves an ignored
    signal ignored. The earlier handler comes back after the test."""
    import signal
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)
