"""The Textual TUI: the only package in dflash that imports Textual."""
