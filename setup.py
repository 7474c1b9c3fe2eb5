"""The one compiled part: commlib.backends._ready, the mpi backend's run of a persistent operation (copies
in and out, start, tests) in one C call, on the hot path of every small blocking call.

Optional: without a C compiler the build goes on without it and commlib runs the same steps in Python
(``commlib.backends._mpi``), most of a microsecond slower per call. Everything else about the package is
in pyproject.toml.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("commlib.backends._ready", ["commlib/backends/_ready.c"], optional=True)])
