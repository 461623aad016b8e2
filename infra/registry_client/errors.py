"""Errors of the Schema Registry, each carrying Confluent's HTTP status and ``error_code``.

The server answers any of them as ``{"error_code": ..., "message": ...}`` with its status;
the client raises the class named by the ``error_code`` it gets back, so both ends agree.
"""

from __future__ import annotations

from agentstream.schemas.errors import AgentstreamError


class RegistryError(AgentstreamError):
    """Base class: a request the registry refused or could not complete."""

    status: int = 500
    error_code: int = 50001

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def body(self) -> dict[str, object]:
        """Confluent's error body."""
        return {"error_code": self.error_code, "message": self.message}


class SubjectNotFound(RegistryError):
    status, error_code = 404, 40401


class VersionNotFound(RegistryError):
    status, error_code = 404, 40402


class SchemaNotFound(RegistryError):
    status, error_code = 404, 40403


class SubjectSoftDeleted(RegistryError):
    """A soft delete of a subject already soft-deleted (``permanent=true`` removes it)."""

    status, error_code = 404, 40404


class SubjectNotSoftDeleted(RegistryError):
    """A permanent delete of a subject that was not soft-deleted first."""

    status, error_code = 404, 40405


class VersionSoftDeleted(RegistryError):
    """A soft delete of a version already soft-deleted (``permanent=true`` removes it)."""

    status, error_code = 404, 40406


class VersionNotSoftDeleted(RegistryError):
    """A permanent delete of a version that was not soft-deleted first."""

    status, error_code = 404, 40407


class SubjectLevelConfigNotFound(RegistryError):
    """``GET /config/{subject}`` for a subject without its own level (and no ``defaultToGlobal``)."""

    status, error_code = 404, 40408


class AssociationNotFound(RegistryError):
    """A delete of associations a resource does not have (none exist in agentstream's registry)."""

    status, error_code = 404, 40410


class SubjectLevelModeNotFound(RegistryError):
    """``GET /mode/{subject}`` for a subject without its own mode (and no ``defaultToGlobal``)."""

    status, error_code = 404, 40409


class IncompatibleSchemaVersion(RegistryError):
    """A new schema version breaks the subject's compatibility level (or agentstream's BACKWARD check).

    Confluent answers ``error_code`` 40901 since its associations release, 409 before; both map here."""

    status, error_code = 409, 40901


class InvalidSchemaError(RegistryError):
    """Not an Avro schema, an unsupported schema type, or schema references (not supported here)."""

    status, error_code = 422, 42201


class InvalidVersion(RegistryError):
    status, error_code = 422, 42202


class InvalidCompatibilityLevel(RegistryError):
    status, error_code = 422, 42203


class InvalidMode(RegistryError):
    status, error_code = 422, 42204


class OperationNotPermitted(RegistryError):
    """A write the subject's mode forbids (READONLY), an import outside IMPORT mode, or a config this registry
    does not keep."""

    status, error_code = 422, 42205


class InvalidSubject(RegistryError):
    """A subject name with a control character (U+0000-U+001F, U+007F-U+009F), which Confluent refuses too."""

    status, error_code = 422, 42208


class NotServed(RegistryError):
    """A request of Confluent's API this registry deliberately does not serve (creating associations)."""

    status, error_code = 501, 50101


class BadRequest(RegistryError):
    """A body that is not the JSON object the endpoint expects."""

    status, error_code = 400, 400


class Unauthorized(RegistryError):
    """A write (POST, PUT, DELETE) without one of ``[security] registry_keys``; to the client, any 401 (a user's
    registry that refused the credentials sent, or wanted some)."""

    status, error_code = 401, 40101


class StoreError(RegistryError):
    """The backing Kafka topic could not be written or read."""

    status, error_code = 500, 50001
    retriable = True


class StoreTimeout(RegistryError):
    """A write did not come back from the backing topic in time."""

    status, error_code = 500, 50002
    retriable = True


class RegistryUnavailable(AgentstreamError, RuntimeError):
    """The registry could not be reached (or answered garbage). Not a ``CodecError``: a record that cannot be
    decoded because the registry is down must not be dead-lettered, the reader should stop and retry."""

    retriable = True


_CLASSES: tuple[type[RegistryError], ...] = (
    SubjectNotFound, VersionNotFound, SchemaNotFound, SubjectSoftDeleted, SubjectNotSoftDeleted, VersionSoftDeleted,
    VersionNotSoftDeleted, SubjectLevelConfigNotFound, SubjectLevelModeNotFound, AssociationNotFound,
    IncompatibleSchemaVersion, InvalidSchemaError, InvalidVersion, InvalidCompatibilityLevel, InvalidMode,
    OperationNotPermitted, InvalidSubject, NotServed, BadRequest, Unauthorized, StoreError, StoreTimeout,
)
BY_CODE: dict[int, type[RegistryError]] = {
    **{cls.error_code: cls for cls in _CLASSES},
    409: IncompatibleSchemaVersion,  # what registries before Confluent's 40901 answer
}


def error_for(status: int, error_code: int | None, message: str) -> RegistryError:
    """The error a registry's answer stands for (by ``error_code``, else a generic one with the status)."""
    cls = BY_CODE.get(error_code or 0)
    if cls is not None:
        return cls(message)
    error = RegistryError(message)
    error.status, error.error_code = status, error_code or status
    return error
