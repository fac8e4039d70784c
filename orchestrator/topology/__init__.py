"""The topology file: its schema, the rules that relate several fields, and loading it with every
problem reported at once (file line, field, fix). Imports nothing above `launch.sglang`'s constants."""
