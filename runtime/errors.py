"""Kiln's typed errors. Every error a user can cause is a ``KilnError`` subclass whose
message names what is wrong; the CLI prints it without a traceback and exits non-zero."""


class KilnError(Exception):
    """Base of every error Kiln raises for bad input or an unusable environment."""


class UnsupportedModelError(KilnError):
    """The model's architecture, files or settings are not something Kiln can compile."""


class ArtifactError(KilnError):
    """An artifact is missing, incomplete, corrupt, or from an incompatible Kiln."""


class DeviceError(KilnError):
    """The artifact's target device is not available on this host."""


class PromptTooLongError(KilnError, ValueError):
    """The prompt (plus requested output) does not fit the artifact's context window."""


class InvalidRequestError(KilnError, ValueError):
    """A generation request has an invalid field (sampling value, stop, message...)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class ConfigError(KilnError, ValueError):
    """A serving option is malformed, or cannot be honoured with this artifact on this host
    (a KV-cache budget larger than the memory available, or too small for one sequence)."""

    def __init__(self, option: str, message: str):
        super().__init__(f"{option}: {message}")
        self.option = option
