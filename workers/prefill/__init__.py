"""The prefill role: computes a prompt's KV and WRITEs it into the paired decode's pages."""
