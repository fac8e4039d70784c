"""The engine thread both roles run: requests and their events, the model and its runner, sampling, kernels."""
