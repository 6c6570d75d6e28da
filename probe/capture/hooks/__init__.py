"""hooks (docstring to come)."""
