"""TFTrainer: the driver side, the worker entry points, Keras checkpoints, Ray Data for TF."""
