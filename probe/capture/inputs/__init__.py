"""inputs (docstring to come)."""
