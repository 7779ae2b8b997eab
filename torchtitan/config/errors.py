class UserError(Exception):
    """A mistake in the user's input (config, paths, data): reported as one clear message, no traceback."""
