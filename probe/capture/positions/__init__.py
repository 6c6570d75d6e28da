"""positions (docstring to come)."""
