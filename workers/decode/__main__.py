"""`python -m dsv4_cluster.workers.decode`: run one embedded decode worker until SIGTERM."""

from ...core import Role
from ..main import main

if __name__ == "__main__":
    main(Role.DECODE)
