"""The libmoe version this package is written against (MOE_VERSION in include/moe/core.h;
tests/python/test_library.py keeps the two equal)."""
__version__ = "0.2.0"
API_MAJOR, API_MINOR = (int(p) for p in __version__.split(".")[:2])
