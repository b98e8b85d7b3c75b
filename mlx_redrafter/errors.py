"""The one exception type for bad user input: the CLI prints it as a single line."""


class UserError(Exception):
    """A problem with what the user asked for; the message says what is wrong and how to fix it."""
