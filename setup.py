"""The native libraries, built with the package (the rest of the metadata is in pyproject.toml).

Two plain C shared libraries (no Python C API), loaded with ctypes by ``shmkv.kernels.native``
from where the build puts them: next to ``shmkv/kernels/native.py``, ``_paged_decode`` and
``_copy_rows`` with the interpreter's extension suffix (an editable install builds them
in place, in ``shmkv/kernels/``). Each is optional: without a C compiler, or when a build fails,
the install still succeeds and shmkv runs its numpy/torch paths (``shmkv stats`` says so).

Compiled for the compiler's baseline, never ``-march=native``: the C chooses its AVX2 and
AVX-512 paths at run time from what the CPU reports, so one build runs on any x86-64 (and
on aarch64, which builds the portable code). ``-ffast-math`` applies to the decode
kernel's compilation only; setuptools links without it (linked in, its start-up code
would set flush-to-zero for the whole process).
"""

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class build_plain_c(build_ext):
    """build_ext for C libraries that are not Python modules: they export no
    ``PyInit_*`` function, so none is asked of the linker."""

    def get_export_symbols(self, ext: Extension) -> list:
        return ext.export_symbols


setup(
    ext_modules=[
        Extension(
            "shmkv.kernels._paged_decode",
            sources=["shmkv/kernels/csrc/paged_decode.c"],
            depends=["shmkv/kernels/csrc/paged_decode_isa.h"],
            extra_compile_args=["-O3", "-ffast-math", "-Wno-psabi"],
            libraries=["m"],
            optional=True,
        ),
        Extension(
            "shmkv.kernels._copy_rows",
            sources=["shmkv/kernels/csrc/copy_rows.c"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
    ],
    cmdclass={"build_ext": build_plain_c},
)
