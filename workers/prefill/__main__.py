"""`python -m dsv4_cluster.workers.prefill`: run one embedded prefill worker until SIGTERM."""

from ...core import Role
from ..main import main

if __name__ == "__main__":
    main(Role.PREFILL)
