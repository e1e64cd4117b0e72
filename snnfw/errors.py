"""Errors a user can cause. Each message says what was wrong and how to fix it.

The CLI turns any :class:`UserError` into one line on stderr and exit status 2.
"""

import contextlib


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


class WorkerError(Exception):
    """An exception that the user's own code raised in a data loader worker, as the rank reports one raised in it:
    ``where`` (:func:`user_line` in the worker), the exception's type name ``kind``, its message and the worker's
    traceback. torch re-raises a worker's exception as a new one whose message is that traceback."""

    def __init__(self, where: str, kind: str, message: str, traceback: str):
        super().__init__(where, kind, message, traceback)
        self.where, self.kind, self.message, self.traceback = where, kind, message, traceback

    def __str__(self) -> str:
        return self.message


class CollectiveError(SystemExit):
    """A collective that timed out or lost a rank: the process group is broken, and the rank ends.

    A ``SystemExit``, so that a script that does not catch it ends with its one line (``code``, "snnfw: error: ...")
    and exit status 1 instead of a traceback; ``str()`` is the line without the prefix.
    """

    def __init__(self, message: str):
        super().__init__(message)
        self.code = f"snnfw: error: {message}"


LONGEST = 200  # characters of a value that a message shows


def shown(value) -> str:
    """``repr(value)``, cut to :data:`LONGEST` characters saying how long it is, so that a message stays readable."""
    return shortened(repr(value))


def shortened(text: str) -> str:
    """``text`` cut to :data:`LONGEST` characters, saying how long it is."""
    return text if len(text) <= LONGEST else f"{text[:LONGEST]}... ({len(text):,} characters)"


def said(err: BaseException, limit: int = 300) -> str:
    """What ``err`` says on one line (its whitespace runs as single spaces), cut to ``limit`` characters."""
    return " ".join(str(err).split())[:limit]


def explain(err: BaseException) -> str:
    """The message with its notes (such as the plugin that raised it) on one line."""
    return "; ".join([str(err), *getattr(err, "__notes__", ())])


def keys_phrase(keys: list[str]) -> tuple[str, str]:
    """A refusal's subject and pronoun: ``("a.b is", "it")`` or ``("a.b, c.d are", "them")``."""
    return (f"{keys[0]} is", "it") if len(keys) == 1 else (f"{', '.join(keys)} are", "them")


def user_line(err: BaseException) -> str:
    """``"FILE, line N, in NAME"`` where the user's own code raised ``err`` or called the library that did: the
    deepest frame of its traceback outside Python's library and installed packages, unless that frame is snnfw's
    (or its plugins'), whose errors are its own; ``""`` where no such frame is. A :class:`WorkerError`: its own."""
    import importlib.util
    import sysconfig
    import traceback
    from pathlib import Path

    if isinstance(err, WorkerError):
        return err.where
    libraries = {Path(sysconfig.get_paths()[key]).resolve() for key in ("stdlib", "platstdlib", "purelib", "platlib")}
    plugins = importlib.util.find_spec("snnfw_plugins")
    own = {Path(__file__).resolve().parent, *(Path(f).resolve() for f in (plugins.submodule_search_locations or []))}
    for frame in reversed(traceback.extract_tb(err.__traceback__)):
        path = Path(frame.filename).resolve()
        if any(path.is_relative_to(root) for root in own):
            return ""
        if frame.filename.startswith("<") or any(path.is_relative_to(root) for root in libraries):
            continue
        named = path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path
        return f"{named}, line {frame.lineno}, in {frame.name}"
    return ""


@contextlib.contextmanager
def users_code(what: str):
    """Turns an exception that the user's code raises while ``what`` runs into a :class:`ConfigError` of one line."""
    try:
        yield
    except UserError:
        raise
    except Exception as err:
        where = user_line(err)
        raise ConfigError(f"{what} raised {type(err).__name__}: {said(err)}"
                          + (f" ({where})" if where else "") + "; correct it (snnfw --debug shows the traceback)") from err
