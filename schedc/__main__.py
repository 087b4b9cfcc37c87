"""`python -m schedc` and `torchrun -m schedc run ...`."""

import sys

from schedc.cli import main

sys.exit(main())
