"""Training-step benchmark: the same as `stableflash bench train` (see --help)."""
import sys

from stableflash.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "train", *sys.argv[1:]]))
