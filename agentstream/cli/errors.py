"""How a command fails: an :class:`AgentstreamError` becomes one line and an exit status that says whether to retry.

The contract, which scripts, supervisors and CI may rely on:

* stderr gets one line, ``error: <message>``; a Kafka setup error's message starts with its class
  (``error: KafkaAccessDenied: ...``, ``error: SessionTimeoutRefused: ...``), so an operator's alert
  or search matches the kind of refusal without parsing the sentence;
* the exit status is :data:`EXIT_PERMANENT` (1) when the error's class is not ``retriable``: the
  same command fails the same way until the input, the configuration or the setup changes;
* and :data:`EXIT_RETRIABLE` (75, ``EX_TEMPFAIL`` of sysexits.h) when it is: a broker, ClickHouse,
  registry or store could not be reached or was busy, and the same command may succeed later.

Click's usage errors (a bad or missing option) keep click's status 2. Any other exception is a bug,
not a refusal, and ends in its traceback. A command that needs an optional extra imports it under
:func:`requires_extra`, which names the ``pip install`` that provides it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

import click

from agentstream.infra.kafka import KafkaSetupError
from agentstream.schemas.errors import AgentstreamError

EXIT_PERMANENT = 1
"""The exit status of a non-retriable AgentstreamError: repeating the command gives the same error."""
EXIT_RETRIABLE = 75
"""The exit status of a retriable AgentstreamError (sysexits.h's EX_TEMPFAIL): the command may succeed later."""


def error_line(error: AgentstreamError) -> str:
    """The one line a failed command prints: ``error: <message>`` (a Kafka setup error names its class first)."""
    kind = f"{type(error).__name__}: " if isinstance(error, KafkaSetupError) else ""
    return f"error: {kind}{error}"


def exit_status(error: AgentstreamError) -> int:
    """:data:`EXIT_RETRIABLE` for a retriable error, else :data:`EXIT_PERMANENT`."""
    return EXIT_RETRIABLE if error.retriable else EXIT_PERMANENT


class AgentstreamGroup(click.Group):
    """The click group of ``agentstream``: every AgentstreamError of every command, handled here once."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except AgentstreamError as error:
            click.secho(error_line(error), fg="red", err=True)
            sys.exit(exit_status(error))


class MissingExtra(AgentstreamError, ImportError):
    """A command needs an optional dependency that is not installed; the message names the pip command."""

    retriable = False

    def __init__(self, command: str, module: str, extra: str) -> None:
        super().__init__(f"{command} needs {module}: pip install 'agentstream[{extra}]'", name=module)
        self.command, self.module, self.extra = command, module, extra


class Interrupted(AgentstreamError):
    """The command was stopped (Ctrl-C or SIGTERM) after stopping what it had started."""


@contextmanager
def requires_extra(extra: str, command: str) -> Iterator[None]:
    """Import what ``command`` needs of ``pip install 'agentstream[extra]'`` under this: a missing module is a
    :class:`MissingExtra` naming that pip command (``extra`` may name several: ``"train,examples"``).

    An ImportError of agentstream's own modules is a bug, not a missing extra, and passes unchanged,
    as does an AgentstreamError that is also an ImportError (an agent that cannot be loaded).
    """
    try:
        yield
    except ImportError as error:
        if isinstance(error, AgentstreamError) or (error.name or "").partition(".")[0] == "agentstream":
            raise
        raise MissingExtra(command, error.name or str(error), extra) from error
