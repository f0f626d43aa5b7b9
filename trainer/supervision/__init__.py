"""Pieces of the in-container supervisor (`python -m trainer.supervise`), torch-free; the
supervise loop itself stays in trainer/supervise.py.

`trainer.config.policy` decides (pure); `flags` parses the command line; `child` spawns, waits
for and signals the trainer; `progress` reads RUN/status.log for the stall watchdog and `stall`
stops a stalled trainer; `restarts` counts restarts in the window and records them;
`filesystems` finds every filesystem the trainer writes to, `disk` checks the checkpoints' one
against retention and `diskwatch` says each change; `procinfo` reads /proc (no privileges);
`console` writes the supervisor's lines; `statefile` owns RUN/supervisor.json (and says on the
pane when it cannot be written).
"""
