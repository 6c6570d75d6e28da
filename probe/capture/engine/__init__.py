"""engine (docstring to come)."""
