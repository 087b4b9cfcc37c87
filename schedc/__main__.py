"""`python -m schedc` and `torchrun -m schedc run ...`."""

import sys

from schedc.cli.main import main

sys.exit(main())
