"""spillover: the planned overflow route of a home AI server."""

__version__ = "0.1.0"
__all__ = ["__version__"]
