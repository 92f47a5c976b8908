"""One exception type for every user-facing failure: the CLI prints its message, no traceback."""


class DominoError(Exception):
    """A problem with the user's input (a file, a flag, a model that does not fit)."""
