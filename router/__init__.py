"""The OpenAI-compatible router: pairs each request across a prefill and a decode worker.

Entry points: `build_app(settings)` in `app.py`, `RouterSettings` in `settings.py`, and
`python -m dsv4_cluster.router --config PATH.json`. Kept import-light so that the orchestrator can
import the settings without pulling in the web stack.
"""
