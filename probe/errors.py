"""User-facing errors.

Every problem a user can fix (bad text, a file that is not a cache, an unknown model) is raised as
:class:`ProbeError` with a one-line message naming the problem and the fix. The CLI prints that
line and exits with code 2, without a traceback.
"""


class ProbeError(ValueError):
    """A problem with the user's input, with a one-line message that says how to fix it."""
