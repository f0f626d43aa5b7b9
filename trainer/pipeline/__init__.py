"""The asynchronous training pipeline: prefetch -> target workers -> drafter step.

Modules: `schedule` (LR), `channels` (stop-aware bounded queues, reorder buffer, wait clocks),
`plan` (the sampler's batches as one numbered sequence), `stages` (prefetch and target threads),
`checkpoint` (atomic save/load/prune), `status` (rates, status lines, reporter), `distributed`
(data parallel), `faults` (test-only fault injection), `runner` (the training loop and CLI glue).
"""
