"""`dflashctl compare`: runs side by side, their held-out tau and losses aligned by step and by
tokens trained (`sources`: which run an argument names; `curves`: a run's curves from its
status.log; `align`: the common points and who is ahead; `report`: text and JSON)."""
