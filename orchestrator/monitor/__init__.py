"""Monitoring beside the cluster: `monitor up|down` (Prometheus + the exporter), the Prometheus config
of a topology, the `file_sd` targets the controller writes, and the exporter of worker states."""
