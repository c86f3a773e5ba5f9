"""Attention benchmark: the same as `stableflash bench attention` (see --help)."""
import sys

from stableflash.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "attention", *sys.argv[1:]]))
