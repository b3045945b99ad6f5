"""`python -m harness_trainer` is `harness-train`."""

import sys

from harness_trainer.commands.cli import main

sys.exit(main())
