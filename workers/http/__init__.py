"""The worker's HTTP surface: request bodies, routes, responses, /metrics, liveness; never touches the model."""
