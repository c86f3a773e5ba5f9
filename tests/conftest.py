"""Shared test helpers. Every test draws fresh random inputs from a seeded generator.

The suite runs one worker process per core (pytest-xdist, ``-n auto`` in pyproject.toml) without a
GPU, and in one process with a GPU, whose tests share the device. A worker's torch and BLAS use
one thread, so two workers on two cores do not contend; `-n 0` runs everything in this process.
Markers: ``gpu`` (skipped without CUDA), ``gpu_timing`` (asserts timings: skipped where several
xdist workers share the GPU, e.g. ``-n 16`` on a GPU machine; the default ``-n auto`` runs GPU
suites in one process), ``slow`` (longer than a few seconds on 2 CPU cores; ``-m "not slow"``
leaves them out for a quick check). This module imports torch only where a test
needs it: xdist's controller process, which only starts the workers, starts them sooner without.
"""
from __future__ import annotations

import os
import sys

if os.environ.get("PYTEST_XDIST_WORKER"):
    for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(_var, "1")

import pytest  # noqa: E402  (after the thread counts are set)

# the device files through which a GPU driver is reached (NVIDIA's, AMD's ROCm, WSL's)
_GPU_DEVICE_FILES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg")


def cuda_available() -> bool:
    """torch.cuda.is_available(); on Linux without a GPU driver's device files, False without
    importing torch (no driver, no device: torch answers False there too)."""
    if sys.platform == "linux" and not any(os.path.exists(path) for path in _GPU_DEVICE_FILES):
        return False
    import torch
    return torch.cuda.is_available()


# Without a GPU, the Triton kernels run in Triton's CPU interpreter; Triton reads this variable
# when the kernels are defined, so it must be set before stableflash.attention.triton is imported.
if not cuda_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if cuda_available() else "cpu"


def _interpreter_without_repeated_setup() -> None:
    """Three costs of Triton's CPU interpreter that repeat work whose result cannot change, removed
    for the tests (the interpreted arithmetic stays Triton's own, bit for bit):

    - at every call of a @triton.jit helper inside a kernel it patches triton.language again
      (inspect.getmembers over tl, tl.tensor, tl.math, a wrapper per builtin), although the launch
      patched those modules already and undoes that only when the kernel returns: a fifth to a third
      of an interpreted kernel's time. Here a helper called during a launch patches only the language
      modules (tl, tl.core) its globals name that this launch has not patched yet, which leaves every
      builtin as the first patch set it;
    - ``_get_np_dtype`` builds its table of twenty types at each of its calls (several per operation):
      here each Triton type's numpy type is looked up once, by the type's name (which spells its
      element type, and for a block its shape; block and pointer types are not hashable);
    - every operation builds the block type of its result (and of each operand it broadcasts or
      casts) and a tensor of it, and each derives its shape, size and name from the dimensions again
      (a tl.tuple of them, a check that each is a power of two, the name's string; the tensor's
      dimensions as constexprs): about a third of an interpreted kernel's time with the two above
      removed. During a launch, a block type of a scalar or pointer element type and integer
      dimensions takes these from the first block type of the same class, element type and
      dimensions (the values Triton computed for it, which nothing changes afterwards), and a tensor
      of such a block type, or of a scalar or pointer type, the dimensions and size computed once for
      that shape. Outside a launch (Gluon's and Triton's compilers) both are Triton's own.

    Applied once, only where the interpreter has the functions it replaces (triton 3.x), else a no-op."""
    if os.environ.get("TRITON_INTERPRET", "0").lower() not in ("1", "true", "on", "yes"):
        return
    if getattr(_interpreter_without_repeated_setup, "applied", False):
        return
    _interpreter_without_repeated_setup.applied = True
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    patch_lang = getattr(interpreter, "_patch_lang", None)
    executor = getattr(interpreter, "GridExecutor", None)
    empty_scope = getattr(interpreter, "_LangPatchScope", None)
    if not (callable(patch_lang) and executor is not None and empty_scope is not None):
        return
    import threading
    launches = threading.local()           # per thread: a stack of the language modules each launch patched
    named = {}                              # function -> the language modules its globals name

    def langs(fn) -> frozenset:
        try:
            return named[fn]
        except KeyError:
            named[fn] = found = frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)
            return found

    def _patch_lang(fn):
        stack = getattr(launches, "stack", None)
        if not stack:                       # outside a launch: as Triton does
            return patch_lang(fn)
        mine = langs(fn)
        if stack[-1] is not None and mine <= stack[-1]:
            return empty_scope()            # a helper: its modules are patched until the launch returns
        scope = patch_lang(fn)              # the launch's own patch (restored by the launch), or new modules
        stack[-1] = mine if stack[-1] is None else stack[-1] | mine
        return scope

    run_grid = executor.__call__

    def __call__(self, *args, **kwargs):
        stack = launches.__dict__.setdefault("stack", [])
        stack.append(None)
        try:
            return run_grid(self, *args, **kwargs)
        finally:
            stack.pop()

    interpreter._patch_lang = _patch_lang
    executor.__call__ = __call__
    # what was replaced, for the test that compares both (tests/attention/test_interpreter_setup.py)
    _interpreter_without_repeated_setup.originals = {(interpreter, "_patch_lang"): patch_lang,
                                                     (executor, "__call__"): run_grid}

    np_dtype = getattr(interpreter, "_get_np_dtype", None)
    if callable(np_dtype):
        known = {}                          # a type's name -> its numpy type

        def _get_np_dtype(tt_dtype):
            name = getattr(tt_dtype, "name", None)
            found = known.get(name) if isinstance(name, str) else None
            if found is None:
                found = np_dtype(tt_dtype)
                if isinstance(name, str):
                    known[name] = found
            return found

        interpreter._get_np_dtype = _get_np_dtype
        _interpreter_without_repeated_setup.originals[(interpreter, "_get_np_dtype")] = np_dtype

    core = getattr(tl, "core", None)
    block_type, tensor = getattr(core, "block_type", None), getattr(core, "tensor", None)
    if block_type is None or tensor is None or not all(
            hasattr(core, name) for name in ("dtype", "pointer_type", "constexpr", "tuple")):
        return
    import builtins
    import math
    block_init, tensor_init = block_type.__init__, tensor.__init__
    constexpr, tl_tuple, element_types = core.constexpr, core.tuple, (core.dtype, core.pointer_type)
    blocks = {}          # (class, element type's class and name, dimensions) -> shape, numel, name (Triton's)
    tensors = {}         # id of a block type's shape in ``blocks`` -> a tensor's numel and shape
    scalar = (constexpr(1), tl_tuple([]))       # what a tensor of a scalar or pointer type computes

    def block_type_init(self, element_ty, shape):
        if getattr(launches, "stack", None) and type(element_ty) in element_types and isinstance(shape, (list, tl_tuple)):
            key = [type(self), type(element_ty), element_ty.name]
            for dim in shape:
                dim = dim.value if type(dim) is constexpr else dim
                if type(dim) is not int:
                    break
                key.append(dim)
            else:
                key = tuple(key)
                found = blocks.get(key)
                if found is None:
                    block_init(self, element_ty, shape)
                    blocks[key] = (self.shape, self.numel, self.name)
                    tensors[id(self.shape)] = (constexpr(math.prod(self.shape)),
                                               tl_tuple([constexpr(dim) for dim in self.shape]))
                    return
                self.element_ty = element_ty
                self.shape, self.numel, self.name = found
                return
        block_init(self, element_ty, shape)

    def tensor_init_once(self, handle, type):        # Triton's signature (``type`` as it names it)
        if getattr(launches, "stack", None):
            kind = builtins.type(type)
            found = tensors.get(id(type.shape)) if kind is block_type else scalar if kind in element_types else None
            if found is not None:
                self.handle = handle
                self.numel, self.shape = found
                self.type = type
                self.dtype = type.scalar
                return
        tensor_init(self, handle, type)

    block_type.__init__ = block_type_init
    tensor.__init__ = tensor_init_once
    _interpreter_without_repeated_setup.originals[(block_type, "__init__")] = block_init
    _interpreter_without_repeated_setup.originals[(tensor, "__init__")] = tensor_init


def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto``: one worker per core this process may use without a GPU; none with one."""
    if cuda_available():
        return 0
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` skip cleanly without a CUDA device. Tests marked ``slow`` run first, in
    their collected order: under ``-n auto`` they start while most of the run is still ahead, and the
    run ends on short tests instead of one worker finishing a long test while the other waits.
    Where tests are collected (a worker, or the one process of ``-n 0``), before any of them runs,
    Triton's interpreter loses its repeated setup (``_interpreter_without_repeated_setup``). With a GPU
    the kernels' launch cache checks each launch it shortcuts (``launch_cache.VERIFY``)."""
    _interpreter_without_repeated_setup()
    # every call whose decision the API keeps is decided again and compared with it
    from stableflash.attention import api
    api.VERIFY = True
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    if cuda_available():
        # every launch the launch cache shortcuts is checked against Triton's own binding
        from stableflash.attention.triton import launch_cache
        launch_cache.VERIFY = True
        workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
        if workers > 1:       # the other workers' kernels share the GPU's time with the timed calls
            shared = pytest.mark.skip(reason=f"asserts GPU timings, which {workers} xdist workers sharing the "
                                             f"GPU disturb; runs without -n (the default -n auto with a GPU)")
            for item in items:
                if item.get_closest_marker("gpu_timing"):
                    item.add_marker(shared)
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _calls_decided_afresh():
    """Each test starts with no kept Call (``attention.api``): a test standing in for the kernels or
    their checks gets decisions made with its stand-ins."""
    from stableflash.attention import api
    api.forget_calls()


def launch_ranks(argv: list[str], nproc: int = 2, timeout: float = 300, expect: int = 0) -> list[str]:
    """``torchrun --standalone --nproc_per_node=nproc -m stableflash.cli *argv`` on the CPU: each rank a
    process running ``stableflash.cli.main(argv)`` with the environment torchrun gives it (RANK,
    LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, one thread; CUDA_VISIBLE_DEVICES
    empty).
    The ranks come from multiprocessing's fork server, which imported torch, torch._dynamo (any
    optimizer imports it) and stableflash once for the whole run: a rank starts in a fraction of a
    second instead of torchrun's launcher and each rank importing them (8 s of the 11 a 3-step tiny
    run takes on two idle cores). Without a fork server (not on Linux) the ranks go through torchrun
    itself; the launcher's own path is ``tests/test_cli.py``'s documented torchrun test. Returns
    each rank's output (stdout and stderr); AssertionError with them if a rank exits with another
    code than ``expect`` or the run passes ``timeout`` seconds."""
    import multiprocessing
    import socket
    import subprocess
    import tempfile
    import time

    if "forkserver" not in multiprocessing.get_all_start_methods():
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), PYTHONFAULTHANDLER="1", CUDA_VISIBLE_DEVICES="")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m",
               "stableflash.cli", *argv]
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        assert res.returncode == expect, res.stderr[:2000] + "\n[...]\n" + res.stderr[-2000:]
        return [res.stdout + res.stderr]
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch._dynamo", "stableflash.cli", "tests.ranks"])
    with socket.socket() as sock:                  # a free port for the ranks' rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    logs = [tempfile.NamedTemporaryFile(prefix=f"rank{rank}-", suffix=".log", delete=False).name for rank in range(nproc)]
    from tests.ranks import rank_main
    ranks = [ctx.Process(target=rank_main, args=(argv, {
        "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "CUDA_VISIBLE_DEVICES": ""}, logs[rank]))
        for rank in range(nproc)]
    for p in ranks:
        p.start()
    deadline = time.monotonic() + timeout
    for p in ranks:
        p.join(max(deadline - time.monotonic(), 0))
    for p in ranks:
        if p.exitcode is None:                     # past the timeout
            p.kill()
            p.join()
    output = [open(log, errors="replace").read() for log in logs]
    for log in logs:
        os.unlink(log)
    codes = [p.exitcode for p in ranks]
    assert codes == [expect] * nproc, (f"ranks' exit codes {codes} (-9: killed after {timeout} s)\n"
                                       + "\n".join(f"--- rank {r}:\n{text[-3000:]}" for r, text in enumerate(output)))
    return output


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


@pytest.fixture(scope="session")
def shared_tmp(tmp_path_factory):
    """A folder every worker of this run shares: the run's base temporary folder (under xdist each
    worker's own base lies inside it)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def made_once(folder, make):
    """``make(folder)``'s result (JSON-able), made by the first test of the run that asks, in any
    worker: under a lock on ``folder``.lock, which a worker asking meanwhile waits for; later callers
    read the result that the first stored beside the folder. Tests that change the folder copy it."""
    import json
    import shutil

    from filelock import FileLock
    with FileLock(f"{folder}.lock"):
        stored = folder.parent / f"{folder.name}.json"
        if not stored.exists():
            shutil.rmtree(folder, ignore_errors=True)            # what a failed first attempt left
            stored.write_text(json.dumps(make(folder), default=str))
        return json.loads(stored.read_text())


@pytest.fixture
def gen(request) -> torch.Generator:
    """A generator seeded from the test's name, so each test has its own reproducible draw."""
    import torch
    seed = sum(map(ord, request.node.name)) * 7919 % (2**31)
    return torch.Generator().manual_seed(seed)


def qkv(gen, b, h, n, d, n_k=None, dtype=None, scale=1.0):
    """q, k, v of shape (b, h, n or n_k, d) in ``dtype`` (default float32)."""
    import torch
    dtype = torch.float32 if dtype is None else dtype
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
