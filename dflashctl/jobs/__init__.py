"""Detached jobs in a host's container (`dflashctl eval`, `dflashctl gate`): one command of the
deployed release in a tmux session of its own, its record under WORKDIR/<kind>/<id>/."""
