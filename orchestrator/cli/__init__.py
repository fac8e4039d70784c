"""The `dsv4-cluster` command: the entry (`main.py`: `status` from the controller's endpoint, no Ray), argument
parsing (`commands.py`, defaults from `cluster/options.py`), the operation subcommands (`ops.py`), the status table
(`table.py`), and `install-service` (`service.py`: the systemd unit)."""
