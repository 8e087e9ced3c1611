"""Full detail's hot path in C (src/fast/_fast.c: what it does, and the Python path in
bundle/sink.py it matches byte for byte), built by `make setup`. Everything else is pyproject.toml's.
A tree without src/ (a copy of the packages alone) builds a pure-Python package: the Python path, as
does a machine without a C compiler or OpenSSL's headers (the extension is optional: a reviewer's
`pip install` of the verifier needs neither; tests/unit/test_fast.py fails under CI=true without it)."""

from pathlib import Path

from setuptools import Extension, setup

_SOURCE = Path(__file__).parent / "src" / "fast" / "_fast.c"
# the fleet publisher's framing (src/fast/_wire.c; the Python path: agent/daemon/fleet_wire.py)
_WIRE = Path(__file__).parent / "src" / "fast" / "_wire.c"
_WIRE_EXT = Extension(
    "evidence.agent.daemon._wire", ["src/fast/_wire.c"], extra_compile_args=["-O2"], optional=True
)
setup(
    ext_modules=([_WIRE_EXT] if _WIRE.exists() else [])
    + (
        [
            Extension(
                "evidence.bundle._fast",
                sources=["src/fast/_fast.c"],
                libraries=["crypto"],  # OpenSSL's SHA-256 (libssl-dev)
                extra_compile_args=["-O2"],
                optional=True,
            )
        ]
        if _SOURCE.exists()
        else []
    )
)
