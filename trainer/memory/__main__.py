import sys

from trainer.memory.cli import main

sys.exit(main())
