"""The asynchronous training pipeline: prefetch -> target workers -> drafter step.

`runner` wires the rest, read top to bottom: `build` (the parts, in one function), `resume`
(which checkpoint, and the plan position it resumes at), `stages` (prefetch and target threads),
`step` (`train_step`, one optimizer step), `reduce` (the step's all-reduce, by field name),
`checkpointer` (due/save/load from the parts' state_dicts) over `checkpoint` (atomic files,
retention), `monitor` (wait clocks, rates, the status line), `signals` (SIGINT/SIGTERM),
`evals` over `evaluate` (held-out evaluation), `track` (experiment trackers). Below them:
`plan` (the sampler's batches as one numbered sequence: the resume position), `channels`
(stop-aware bounded queues, reorder buffer, wait clocks), `status` (reporter, status lines,
run-state.json's one writer), `schedule` (LR), `distributed` (data parallel), `faults`
(test-only fault injection), `assets` (store, target, drafter construction).
"""
