"""Reusable panes for the host and fleet screens."""
