"""The one-sample overfit gate: `python -m trainer.gate --config RUN.toml` (see `cli`)."""
