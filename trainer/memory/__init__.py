"""Will a run fit its GPUs? A torch-free memory estimate from the run config (`python -m
trainer.memory`): shapes (`shapes`), per-op byte counts (`costs`), the sampler's batch shapes
(`batches`) and the per-device report (`estimate`). `measure` (torch) validates the costs."""
