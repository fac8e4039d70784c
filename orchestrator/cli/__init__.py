"""The `dsv4-cluster` command: argument parsing (`main.py`, defaults from `cluster/options.py`), the
operation subcommands (`ops.py`), the status table, and `install-service` (the systemd unit)."""
