"""One error policy for kasoku: user mistakes raise ``ValueError`` subclasses whose message says
what to do; a run that diverged raises ``NonFiniteError``; internal invariants use ``assert``.
Warnings are ``KasokuWarning``s, given once per cause (``warn_once``); the command line prints each
as one line, ``kasoku: warning: ...``."""
from __future__ import annotations

import warnings


class DataError(ValueError):
    """Bad or missing input data. The message names the file and what is wrong with it."""


class ConfigError(ValueError):
    """An invalid setting or combination of settings. The message says which and what to use."""


class NonFiniteError(RuntimeError):
    """The loss or a parameter became NaN or Inf: the run diverged (the work failed, not the
    user's input)."""


class KasokuWarning(UserWarning):
    """Something the user should know that does not stop the run: a setting without effect on
    this machine, a bad file skipped, a resume that cannot be exact."""


_warned: set[tuple[type, str]] = set()


def warn_once(message: str, category: type[Warning] = KasokuWarning) -> None:
    """Warn with ``message`` the first time this process meets it (a bench run, a test
    session, a training run that skips a hundred bad files of one kind all warn once)."""
    key = (category, message)
    if key in _warned:
        return
    _warned.add(key)
    warnings.warn(message, category, stacklevel=3)


def reset_warnings() -> None:
    """Forget which warnings were given (for tests)."""
    _warned.clear()
