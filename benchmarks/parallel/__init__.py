"""The mesh-parallel benchmark (issue 42): native torchrun script vs polytrain on 4 workers."""
