import sys

from trainer.measure.cli import main

sys.exit(main())
