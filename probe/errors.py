"""User-facing errors.

Every problem a user can fix (bad text, a file that is not a cache, an unknown model) is raised as
:class:`ProbeError` with a one-line message naming the problem and the fix. The CLI prints that
line and exits with code 2, without a traceback.
"""


class ProbeError(ValueError):
    """A problem with the user's input, with a one-line message that says how to fix it."""


def describe_os_error(e: OSError, action: str = "cannot write") -> str:
    """One line for an ``OSError``: the path, what the system said and what to do about it."""
    import errno

    where = f" {e.filename}" if getattr(e, "filename", None) else ""
    what = e.strerror or type(e).__name__
    fixes = {
        errno.ENOSPC: "free some space or write somewhere else",
        errno.EDQUOT: "free some space or write somewhere else",
        errno.EACCES: "check the permissions or choose another path",
        errno.EPERM: "check the permissions or choose another path",
        errno.EROFS: "the file system is read-only; choose another path",
        errno.ENOTDIR: "a part of the path is a file, not a folder; choose another path",
        errno.EISDIR: "the path is a folder; give a file name",
        errno.ENOENT: "check the path",
        errno.EPIPE: "the reader went away",
    }
    return f"{action}{where}: {what}; {fixes.get(e.errno, 'check the path and try again')}"
