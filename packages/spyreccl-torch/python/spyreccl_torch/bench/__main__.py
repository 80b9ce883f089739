"""``python -m spyreccl_torch.bench``: see :mod:`spyreccl_torch.bench.cli`."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
