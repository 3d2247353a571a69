"""`python -m vanilla_transformer.cli`, as `accelerate launch -m vanilla_transformer.cli train` runs it."""

import sys

from . import main

sys.exit(main())
