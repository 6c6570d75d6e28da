"""consumers (docstring to come)."""
