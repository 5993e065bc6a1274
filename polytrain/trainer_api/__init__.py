"""What the user touches on the driver: trainers, configs, the training operator."""
