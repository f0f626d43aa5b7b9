"""`python -m trainer.measure`: batching strategies timed in the real pipeline, side by side.

Not `trainer.memory.measure` (the memory estimate's allocator check). See `cli` for the command,
`drive` for how the pipeline is run, `report` for the rates, ratios and the step-cost fit.
"""
