"""What `evidence` costs before a command runs: the parser imports the chosen command's module only
(none for `evidence --help` or a typo), and nothing on the way to `run` searches for a library with
ctypes.util.find_library (which runs `ldconfig -p`, and gcc when that fails, at every start).

Each check runs in a fresh interpreter, so that what this test process imported does not count."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PROBE = r"""
import json, sys
from evidence.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as e:
    code = e.code
print(json.dumps([code, sorted(m for m in sys.modules if m.startswith("evidence."))]))
"""


def _modules(*argv: str) -> tuple[int, list[str]]:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=60, check=True
    )
    code, modules = json.loads(proc.stdout.splitlines()[-1])
    return code, modules


@pytest.mark.parametrize(("argv", "code"), [(("--help",), 0), (("bogus",), 2), ((), 2), (("--version",), 0)])
def test_without_a_command_no_command_module_is_imported(argv: tuple[str, ...], code: int) -> None:
    got, modules = _modules(*argv)
    assert got == code
    assert modules == ["evidence.cli", "evidence.errors"]


def test_a_command_imports_its_own_module_and_no_other() -> None:
    code, modules = _modules("diff", "--help")
    assert code == 0
    assert "evidence.bundle.diff" in modules
    assert not [m for m in modules if m.startswith(("evidence.agent", "evidence.policy", "evidence.probes"))]
    code, modules = _modules("run", "--help")
    assert code == 0 and "evidence.agent.commands.run" in modules
    assert not [m for m in modules if m.startswith(("evidence.bundle.", "evidence.policy"))]


def test_the_kernel_module_finds_libc_without_a_search() -> None:
    code = (
        "import ctypes.util\n"
        "def refuse(name):\n"
        "    raise AssertionError(f'find_library({name!r}) called')\n"
        "ctypes.util.find_library = refuse\n"
        "import os\n"
        "from evidence.agent.recorder import kernel\n"
        "from evidence.policy.landlock_syscalls import abi_version\n"
        "print(kernel._libc.getpid() == os.getpid(), kernel.landlock_abi() == abi_version())\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "True"]  # libc's functions answer through the handle
