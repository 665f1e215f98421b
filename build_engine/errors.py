"""One base error for every failure the user can fix, so the CLI reports them all the same way."""


class BuildError(Exception):
    """A problem with the inputs or settings of a build; its message tells the user what to change."""
