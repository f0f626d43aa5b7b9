"""`dflashctl doctor`: is this container ready to train? The node's and the container's facts
(`facts`, read by the scripts in `dflashctl.remote.doctor_probe`), the run config's needs
(`needs`), the rules with their fixes (`checks`, `group`), the runs against a host (`run`) and
the per-release quick-check stamp deploy and start consult (`cache`)."""
