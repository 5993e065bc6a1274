"""Ray clusters: connecting, the autoscaler's view, Ray Jobs (no trainer, no backend)."""
