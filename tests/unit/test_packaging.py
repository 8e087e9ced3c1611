"""The package as a user installs it: one top-level package (`evidence`), and a plain install that is
a verifier. A wheel is built from this tree and installed without extras into a fresh venv (no
system site-packages, so no BCC); there it lints, shows and diffs a real bundle, and the commands
that need the agent extra say so in one line."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.unit import conftest_bundles as cb

REPO = Path(__file__).resolve().parents[2]
BASE_PYTHON = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else sys.executable


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    build = tmp_path_factory.mktemp("build")
    # a copy of the tree (symlinks kept), so building leaves no build/ or egg-info in the checkout
    subprocess.run(
        [
            "cp",
            "-a",
            *(
                str(REPO / n)
                for n in ("pyproject.toml", "evidence", "agent", "bundle", "policy", "probes", "README.md")
            ),
            str(build),
        ],
        check=True,
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(out),
            str(build),
        ],
        check=True,
        capture_output=True,
    )
    (whl,) = out.glob("evidence-*.whl")
    return whl


def test_the_wheel_installs_one_top_level_package_with_its_data(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert top == {"evidence"}
    for needed in (
        "evidence/probes/record.bpf.c",
        "evidence/probes/connect_guard.bpf.c",
        "evidence/bundle/schemas/manifest.schema.json",
        "evidence/policy/default-ci.yaml",
        "evidence/agent/recorder/recording.py",
        "evidence/agent/daemon/service.py",
        "evidence/agent/commands/run.py",
    ):
        assert needed in names, needed
    meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
    text = zipfile.ZipFile(wheel).read(meta).decode()
    requires = [
        line.removeprefix("Requires-Dist:").replace("'", '"')
        for line in text.splitlines()
        if line.startswith("Requires-Dist:")
    ]
    plain = sorted(re.match(r"\s*([\w.-]+)", r).group(1) for r in requires if "extra ==" not in r)  # type: ignore[union-attr]
    assert plain == ["cryptography", "orjson", "pydantic", "pyyaml", "zstandard"]
    for extra in ("pyroute2", "cloudevents", "pydantic-settings", "prometheus-client"):
        assert any(extra in r and 'extra == "agent"' in r for r in requires), extra


def test_a_plain_install_verifies_bundles_and_names_the_extra(wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([BASE_PYTHON, "-m", "venv", str(venv)], check=True)
    pip = subprocess.run(
        [str(venv / "bin/pip"), "install", "-q", "--disable-pip-version-check", str(wheel)],
        capture_output=True,
        text=True,
    )
    assert pip.returncode == 0, pip.stderr
    evidence = str(venv / "bin/evidence")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    a = cb.write(tmp_path / "a.tar.gz")
    b = cb.write(tmp_path / "b.tar.gz", cb.records()[:-1], session_id="sess-2")

    def ev(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([evidence, *args], capture_output=True, text=True, cwd=tmp_path, env=env)

    lint = ev("lint", str(a), "--fail-on", "none")
    assert lint.returncode == 0, lint.stderr
    assert "verified" in lint.stdout + lint.stderr
    assert ev("show", str(a)).returncode == 0
    assert ev("diff", str(a), str(b)).returncode in (0, 1)
    assert ev("profile", str(a)).returncode == 0
    # signing keys and signed bundles: made and checked with nothing but the plain install
    keygen = ev("keygen", "--out", str(tmp_path / "key"))
    assert keygen.returncode == 0, keygen.stderr
    from evidence.bundle.signing import load_signer

    signed = tmp_path / "signed.tar.gz"
    cb.write_bundle(signed, cb.meta(), lambda: iter(cb.records()), signer=load_signer(tmp_path / "key"))
    verify = ev("verify", str(signed), "--key", str(tmp_path / "key.pub"))
    assert verify.returncode == 0, verify.stderr
    assert ev("verify", str(a), "--key", str(tmp_path / "key.pub")).returncode == 2
    # nothing of the agent's is installed, and no module but `evidence` is importable
    probe = subprocess.run(
        [
            str(venv / "bin/python"),
            "-c",
            "import importlib.util as u; print([m for m in ('bundle', 'agent', 'policy', 'probes', 'pyroute2', 'cloudevents', 'bcc') if u.find_spec(m)])",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
    )
    assert probe.stdout.strip() == "[]", probe.stdout + probe.stderr
    for cmd in (["run", "--", "true"], ["agent"]):
        r = ev(*cmd)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 70, (cmd, r.stderr)
        assert len(lines) == 1 and "pip install 'evidence[agent]'" in lines[0], (cmd, r.stderr)
    # the clients need nothing of the extra: they run in job containers and only talk to the agent
    sock = str(tmp_path / "no-agent.sock")
    for cmd in (
        ["start", "--agent", sock, "--pid", "1"],
        ["finish", "--agent", sock, "x"],
        ["run", "--agent", sock, "--", "true"],
    ):
        r = ev(*cmd)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 70 and len(lines) == 1 and "extra" not in lines[0], (cmd, r.stderr)
