"""Pieces of the in-container supervisor (`python -m trainer.supervise`), torch-free.

`trainer.config.policy` decides (pure), `progress` reads RUN/status.log for the stall watchdog, `procinfo` reads
/proc (no privileges), `statefile` owns RUN/supervisor.json.
"""
