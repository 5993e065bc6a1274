"""A trainer's options: typed option groups and YAML run configs."""
