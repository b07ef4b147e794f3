"""`python -m benchmarks NAME ...` from the clone's root: the same as `tfdist bench NAME ...`."""

import sys

from tfdist.cli import main

sys.exit(main(["bench", *sys.argv[1:]]))
