"""Exceptions raised by specdec for bad input; each message names the problem and what to do."""


class SpecdecError(Exception):
    """Base class of every error specdec raises on purpose."""


class CheckpointError(SpecdecError, ValueError):
    """A checkpoint path, file or format that cannot be loaded."""


class UnsupportedModelError(SpecdecError, ValueError):
    """A model architecture the runtime does not implement."""


class CatalogueError(SpecdecError, LookupError):
    """An unknown catalogue name, or a catalogue entry that cannot be fetched."""


class ContextLengthError(SpecdecError, ValueError):
    """A request that does not fit the model's positions or the cache."""


class CacheMemoryError(SpecdecError, MemoryError):
    """A KV cache that would not fit in the memory of its device."""


class CacheHomeError(SpecdecError, OSError):
    """SPECDEC_HOME (default ~/.cache/specdec) names no directory specdec can keep its caches in."""


class DiskFullError(SpecdecError, OSError):
    """A write that ran out of disk space; the message names the path, the space needed (when known)
    and what to do. Nothing partial is kept: every writer that maps to it writes atomically."""
