"""generation (docstring to come)."""
