"""The warning class every warning of the package derives from.

Users and tests can filter or escalate them together::

    import warnings
    from lightning_determinism import DeterminismWarning

    warnings.simplefilter("error", DeterminismWarning)
"""


class DeterminismWarning(UserWarning):
    """Something may make a run less reproducible than the user asked for.

    Examples:
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     warnings.warn("cuBLAS was initialised already", DeterminismWarning)
        >>> caught[0].category.__name__
        'DeterminismWarning'
    """


class IncompatibleVersionError(RuntimeError):
    """The installed Lightning, Fabric, torch or torchmetrics lacks a private piece the package relies on.

    Raised when the package is imported (and where an attribute is read at run time), naming the installed versions
    and every missing piece; see ``docs/compatibility.md`` for the tested versions.

    Examples:
        >>> issubclass(IncompatibleVersionError, RuntimeError)
        True
    """
