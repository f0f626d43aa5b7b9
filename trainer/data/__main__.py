"""Entry point: `python -m trainer.data import|synth|info|show` (see trainer/data/cli.py)."""

import sys

from trainer.data.cli import main

sys.exit(main())
