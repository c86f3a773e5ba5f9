"""One rank of ``tests.conftest.launch_ranks``, in a module of its own: the fork server imports it
(and torch, torch._dynamo, stableflash.cli) once, without the test suite's conftest, which asks
torch whether a GPU is there and could so start the CUDA driver in a process the ranks fork from."""
import os
import sys


def rank_main(argv: list[str], env: dict, log: str) -> None:
    """torchrun's environment and its one thread a rank (OMP_NUM_THREADS=1), output to ``log``,
    ``stableflash.cli.main(argv)``; a nonzero return is the process's exit code."""
    import torch
    os.environ.update(env, OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    out = os.open(log, os.O_WRONLY | os.O_TRUNC)
    os.dup2(out, 1)
    os.dup2(out, 2)
    from stableflash import cli
    code = cli.main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        raise SystemExit(code)
