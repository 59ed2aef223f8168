"""ckptd: a per-node asynchronous checkpoint daemon (see README.md and FORMAT.md)."""
__version__ = "0.1.0"
