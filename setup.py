"""The one compiled part: commlib.backends._ready, commlib's hot paths in C: the mpi backend's run of a
persistent operation (copies in and out, start, tests), the spin of a large wait, the group layer's
ready path of the small calls (checks, lookup, numbering, flight recorder) in one C call each, and a
large blocking call posted on the caller's arrays and tested in one C call (``_direct.c``).

Optional: without a C compiler the build goes on without it and commlib runs the same steps in Python
(``commlib.backends._mpi``, ``commlib._collectives``), about a microsecond slower per small call.
Everything else about the package is in pyproject.toml.
"""

from setuptools import Extension, setup

SOURCES = ["commlib/backends/_ready.c", "commlib/backends/_direct.c"]
setup(
    ext_modules=[
        Extension("commlib.backends._ready", SOURCES, depends=["commlib/backends/_ready.h"], optional=True),
    ]
)
