"""`stableflash bench train`, then the Triton tuners' picks and their candidates' timings in that process.

    python benchmarks/tools/train_tuner_picks.py bench train --attention sdpa --attention triton --out F.json

Prints the bench's table, then two lines: ``CHOICES`` (``op.tuned_choices()``: each tuner's pick per
key) and ``TIMINGS`` (``op.tuner_timings``: median, 20th and 80th percentile ms of every candidate at
the tuner's last tuning), each as JSON. Triton tunes anew in every process; under torch.compile the
forward and backward are tuned while the step is traced, so these are the tiles that process's step ran.
"""
import json
import sys

from stableflash.cli import main as cli_main


def main(argv=None) -> int:
    rc = cli_main(sys.argv[1:] if argv is None else argv)
    from stableflash.attention.triton import op
    print("CHOICES", json.dumps(op.tuned_choices()))
    print("TIMINGS", json.dumps(op.tuner_timings(["fwd", "fwd_tma", "dkdv", "dq"])))
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
