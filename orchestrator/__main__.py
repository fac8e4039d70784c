"""`python -m dsv4_cluster.orchestrator` is the `dsv4-cluster` command."""

import sys

from dsv4_cluster.orchestrator.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
