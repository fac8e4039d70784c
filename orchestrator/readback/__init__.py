"""What a running worker is read back as, never what it was told: readiness and KV usage over HTTP,
stranded KV from its `/metrics`, CPU/NUMA pinning from `/proc`, GPUs held from the NVIDIA driver."""
