"""Ray Train's own test cases, run against ``polytrain.train`` (one file per Ray test file)."""
