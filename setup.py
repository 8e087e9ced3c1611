"""The compiled hot paths (src/fast/*.c; bundle/native.py says what each is for and the Python path
it matches), built by `make setup`. Everything else is pyproject.toml's. Each is optional: a tree
without src/ (a copy of the packages alone) builds a pure-Python package, as does a machine without
a C compiler or OpenSSL's headers (a reviewer's `pip install` of the verifier needs neither); under
CI=true tests/unit/test_native.py fails when it is not built."""

from pathlib import Path

from setuptools import Extension, setup

_HERE = Path(__file__).parent
_EXTENSIONS = [
    # full detail (bundle/sink.py, agent/recorder/{pipeline,correlate}.py, bundle/{premade,run_id}.py)
    Extension(
        "evidence.bundle._fast",
        sources=["src/fast/_fast.c"],
        depends=["src/fast/buf.h", "src/fast/zfile.h", "src/fast/lines.h"],
        libraries=["crypto", "zstd"],  # OpenSSL's SHA-256 (libssl-dev), libzstd (libzstd-dev)
        extra_compile_args=["-O2"],
        optional=True,
    ),
    # the exec supervisor's usual request, its wait and an allowed exec's answer (exec_resolve.py,
    # exec_supervisor.py)
    Extension(
        "evidence.agent.recorder._exec",
        sources=["src/fast/_exec.c"],
        extra_compile_args=["-O2"],
        optional=True,
    ),
    # the verifying reader's fast path over event lines (bundle/fastpath.py `fast`: lint, verify, the
    # fleet publisher's index entries)
    Extension(
        "evidence.bundle._verify",
        sources=["src/fast/_verify.c"],
        depends=["src/fast/buf.h"],
        libraries=["crypto"],  # OpenSSL's SHA-256 (libssl-dev)
        extra_compile_args=["-O2"],
        optional=True,
    ),
    # the fleet publisher's framing of live events and its acknowledgements' read (fleet_wire.py)
    Extension(
        "evidence.agent.daemon._wire",
        sources=["src/fast/_wire.c"],
        depends=["src/fast/buf.h"],
        extra_compile_args=["-O2"],
        optional=True,
    ),
]
setup(ext_modules=[e for e in _EXTENSIONS if all((_HERE / s).exists() for s in e.sources)])
