"""How worker processes start and run functions. Knows nothing of trainers or backends."""
