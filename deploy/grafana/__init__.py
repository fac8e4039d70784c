"""Grafana dashboards of a dsv4-cluster, generated from code (`dashboards.py`, `panels.py`)."""
