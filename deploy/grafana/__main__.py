"""`python -m dsv4_cluster.deploy.grafana`: regenerate the checked-in dashboards and provisioning."""

from __future__ import annotations

from .dashboards import HERE, write_all

if __name__ == "__main__":
    for path in write_all(HERE / "dashboards", HERE / "provisioning"):
        print(path)
