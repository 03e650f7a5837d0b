"""One error policy for kasoku: user mistakes raise ``ValueError`` subclasses whose message says
what to do; internal invariants use ``assert``."""


class DataError(ValueError):
    """Bad or missing input data. The message names the file and what is wrong with it."""


class ConfigError(ValueError):
    """An invalid setting or combination of settings. The message says which and what to use."""
