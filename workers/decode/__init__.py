"""The decode role: reserves KV pages, waits for the prefill's WRITE, then decodes in a continuous batch."""
