"""The one compiled part: commlib.backends._executor, the mpi backend's executor in C (``_steps.c``: a plan of
``commlib.backends._plans`` run with its messages, stamp checks and reductions in C; ``_executor.c``: the module,
its MPI set-up and the constants it shares with Python).

Optional: without a C compiler (or numpy's headers) the build goes on without it and commlib runs the same
plans in Python (``commlib.backends._steps``), exchanging the same messages, slower per call.
Everything else about the package is in pyproject.toml.
"""

from setuptools import Extension, setup


def _numpy_include() -> list[str]:
    try:
        import numpy
    except ImportError:  # no numpy in the build environment: the extension is skipped (it is optional)
        return []
    return [numpy.get_include()]


SOURCES = ["commlib/backends/_executor.c", "commlib/backends/_steps.c"]
setup(
    ext_modules=[
        Extension(
            "commlib.backends._executor",
            SOURCES,
            depends=["commlib/backends/_executor.h"],
            include_dirs=_numpy_include(),
            optional=True,
        ),
    ]
)
