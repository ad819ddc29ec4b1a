"""The compiled part of ckptfs (the request thread's reader, fs/_fastreader.c);
everything else is declared in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "ckptfs.fs._fastreader",
            ["fs/_fastreader.c"],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-missing-field-initializers"],
        )
    ]
)
