"""One exception type for every user-facing failure: the CLI prints its message, no traceback."""


class DominoError(Exception):
    """A problem with the user's input (a file, a flag, a model that does not fit)."""


def flag(name: str) -> str:
    """How a message names a setting: its command-line flag (max_new_tokens -> --max-new-tokens)."""
    return "--" + name.replace("_", "-")
