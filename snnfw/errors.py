"""Errors a user can cause. Each message says what was wrong and how to fix it.

The CLI turns any :class:`UserError` into one line on stderr and exit status 2.
"""


class UserError(Exception):
    """A mistake in a config, a name or a request; not a bug in snnfw."""


class ConfigError(UserError):
    """The config file or a ``--set`` override is malformed."""


class UnknownNameError(UserError):
    """A strategy, family, data set or schedule name that no plugin registered."""


class PlanError(UserError):
    """The requested parallel layout cannot run on the given world."""


class PluginError(UserError):
    """Plugins failed to load, clash, or differ between ranks."""


class DataError(UserError):
    """A data set folder is missing or not in the layout its plugin reads."""


class CheckpointError(UserError):
    """A checkpoint cannot be written or resumed from as asked."""


class DivergedError(UserError):
    """Training produced a non-finite loss."""


LONGEST = 200  # characters of a value that a message shows


def shown(value) -> str:
    """``repr(value)``, cut to :data:`LONGEST` characters saying how long it is, so that a message stays readable."""
    return shortened(repr(value))


def shortened(text: str) -> str:
    """``text`` cut to :data:`LONGEST` characters, saying how long it is."""
    return text if len(text) <= LONGEST else f"{text[:LONGEST]}... ({len(text):,} characters)"


def explain(err: BaseException) -> str:
    """The message with its notes (such as the plugin that raised it) on one line."""
    return "; ".join([str(err), *getattr(err, "__notes__", ())])


def keys_phrase(keys: list[str]) -> tuple[str, str]:
    """A refusal's subject and pronoun: ``("a.b is", "it")`` or ``("a.b, c.d are", "them")``."""
    return (f"{keys[0]} is", "it") if len(keys) == 1 else (f"{', '.join(keys)} are", "them")
