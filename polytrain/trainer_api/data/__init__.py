"""Training data on the workers: distributed samplers, the data position, Ray Data input."""
