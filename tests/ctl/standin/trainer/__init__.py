"""Stand-in trainer for run-control tests: speaks the status-line contract, checkpoints on SIGINT.

Shipped by the tests as a release tree (never imported by pytest). The real trainer is exercised
by the end-to-end test; this one keeps control tests fast and independent of torch.
"""
