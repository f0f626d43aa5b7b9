"""`python -m trainer.regen`: see trainer.regen.cli."""

import sys

from trainer.regen.cli import main

sys.exit(main())
