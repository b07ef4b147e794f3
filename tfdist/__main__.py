"""`python -m tfdist` runs the tfdist command."""

import sys

from tfdist.cli import main

sys.exit(main())
