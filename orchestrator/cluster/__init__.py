"""The running cluster as the CLI's Ray driver sees it: the `up`, `status` and `down` sequences and their
options (the CLI's defaults), the day-two operations (drain, restart, logs), the Ray head it starts or
joins and the environment Ray runs with, and the run record that lets `status` and `down` work without
arguments."""
