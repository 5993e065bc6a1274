"""The ground floor: dependency checks and version switches. Imports nothing of polytrain."""
