from trainer.gate.cli import main

raise SystemExit(main())
