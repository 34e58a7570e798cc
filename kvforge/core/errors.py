"""One exception hierarchy. Messages say what was wrong and what to do about it."""


class KvforgeError(Exception):
    """Base class: the CLI prints str(err) on one line and exits non-zero."""


class InputError(KvforgeError):
    """The caller passed something unusable (folder, prompt, option)."""


class UnsupportedModelError(KvforgeError):
    """The model's architecture or a feature of it is not supported."""


class ExportError(KvforgeError):
    """Export failed part-way; nothing was left in the output folder."""


class ManifestError(KvforgeError):
    """An export folder is missing, incomplete, tampered with or from another kvforge format."""


class GrammarError(InputError):
    """A request's grammar failed while its row generated (llguidance's limits, or no token allowed):
    that request ends, the others go on (HTTP 400 for its client)."""


class CapacityError(InputError):
    """A request does not fit in the KV cache capacity."""


class BackendUnavailableError(KvforgeError):
    """The requested backend (CUDA, TensorRT) is not installed or has no device."""


class ParityError(KvforgeError):
    """Outputs diverged from the reference beyond the stated tolerances."""


class NumericalError(KvforgeError):
    """The model produced NaN logits: corrupted weights, or an overflow in a low-precision export."""

    def __init__(self, message: str, step: int | None = None) -> None:
        super().__init__(message)
        self.step = step


class QueueFullError(KvforgeError):
    """The serving scheduler's queue is full (HTTP 429)."""
