"""One screen per mode: fleet overview, host detail, full log, modals, help."""
