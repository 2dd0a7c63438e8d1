"""The recipe that trains the embedded default pair (see README.md here)."""
