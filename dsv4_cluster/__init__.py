"""dsv4-cluster: prefill/decode disaggregated serving of DeepSeek-V4-Flash.

The repo-root folders (orchestrator/, router/, workers/, kernels/) install as subpackages of
this package; see pyproject.toml.
"""

__version__ = "0.1.0"
