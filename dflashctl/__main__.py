"""`python -m dflashctl`: the command line, as the `dflashctl` script runs it."""

import sys

from dflashctl.cli.main import main

sys.exit(main())
