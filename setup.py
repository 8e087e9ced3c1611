"""Full detail's hot path in C (src/fast/_fast.c: what it does, and the Python path in
bundle/sink.py it matches byte for byte), built by `make setup`. Everything else is pyproject.toml's.
A tree without src/ (a copy of the packages alone) builds a pure-Python package: the Python path, as
does a machine without a C compiler or OpenSSL's headers (the extension is optional: a reviewer's
`pip install` of the verifier needs neither; tests/unit/test_fast.py fails under CI=true without it)."""

from pathlib import Path

from setuptools import Extension, setup

_SOURCE = Path(__file__).parent / "src" / "fast" / "_fast.c"
setup(
    ext_modules=[
        Extension(
            "evidence.bundle._fast",
            sources=["src/fast/_fast.c"],
            libraries=["crypto"],  # OpenSSL's SHA-256 (libssl-dev)
            extra_compile_args=["-O2"],
            optional=True,
        ),
        # the exec supervisor's usual request (src/fast/_exec.c; exec_resolve.py is the reference)
        Extension(
            "evidence.agent.recorder._exec",
            sources=["src/fast/_exec.c"],
            extra_compile_args=["-O2"],
            optional=True,
        ),
    ]
    if _SOURCE.exists()
    else []
)
