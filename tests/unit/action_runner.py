"""Runs a composite GitHub Action's steps here, as a runner would: deploy/github/action.yml is read
with pyyaml, each `run:` step executed with bash (`bash --noprofile --norc -eo pipefail`, GitHub's
own invocation) with its `env:`, `working-directory` and `if:` evaluated, a fresh $GITHUB_OUTPUT per
step, and one $GITHUB_STEP_SUMMARY and $GITHUB_ENV for the job. `uses:` steps are not run: they are
returned with their evaluated `with:`, for the test to check.

Expressions: the subset the action uses (`inputs.x`, `steps.x.outputs.y`, string literals, `==`,
`!=`, `&&`, `||`), evaluated as GitHub does (empty string is false; `a || b` is a's value if truthy).
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import yaml

ACTION = Path(__file__).resolve().parents[2] / "deploy" / "github" / "action.yml"
_TOKEN = re.compile(r"\s*(==|!=|&&|\|\||\(|\)|'(?:[^']|'')*'|[A-Za-z_][A-Za-z0-9_.-]*)")


@dataclasses.dataclass
class Result:
    outputs: dict[str, dict[str, str]]  # step id -> its outputs
    ran: list[str]  # names of the steps run (or, for uses: steps, that would run)
    uses: list[tuple[str, dict[str, str]]]  # (action, with) of the uses: steps that would run
    summary: str
    stdout: dict[str, str]  # step name -> its stdout
    codes: dict[str, int]  # step name -> exit code
    failed: str | None  # the step that failed (the job stops there), or None
    action_outputs: dict[str, str]


class Expr:
    def __init__(self, text: str, ctx: dict[str, Any]) -> None:
        self.tokens = [m.group(1) for m in _TOKEN.finditer(text)]
        self.ctx = ctx
        self.pos = 0

    def value(self) -> str:
        v = self._or()
        assert self.pos == len(self.tokens), self.tokens
        return v

    def _peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def _or(self) -> str:
        v = self._and()
        while self._peek() == "||":
            self.pos += 1
            w = self._and()
            v = v if v else w
        return v

    def _and(self) -> str:
        v = self._cmp()
        while self._peek() == "&&":
            self.pos += 1
            w = self._cmp()
            v = w if v else v
        return v

    def _cmp(self) -> str:
        v = self._atom()
        op = self._peek()
        if op in ("==", "!="):
            self.pos += 1
            w = self._atom()
            return "true" if (v == w) == (op == "==") else ""
        return v

    def _atom(self) -> str:
        tok = self.tokens[self.pos]
        self.pos += 1
        if tok == "(":
            v = self._or()
            assert self.tokens[self.pos] == ")"
            self.pos += 1
            return v
        if tok.startswith("'"):
            return tok[1:-1].replace("''", "'")
        node: Any = self.ctx
        for part in tok.split("."):
            node = node.get(part, "") if isinstance(node, dict) else ""
        return str(node)


def evaluate(text: str, ctx: dict[str, Any]) -> str:
    """A `${{ }}`-bearing string with every expression replaced by its value."""
    return re.sub(r"\$\{\{(.*?)\}\}", lambda m: Expr(m.group(1), ctx).value(), str(text))


def _read_outputs(path: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if "<<" in line and ("=" not in line or line.index("<<") < line.index("=")):
            name, delim = line.split("<<", 1)
            j = lines.index(delim, i + 1)
            out[name] = "\n".join(lines[i + 1 : j])
            i = j + 1
        else:
            name, _, value = line.partition("=")
            out[name] = value
            i += 1
    return out


def run_action(
    inputs: dict[str, str], workdir: Path, env: dict[str, str] | None = None, action: Path = ACTION
) -> Result:
    spec = yaml.safe_load(action.read_text())
    assert spec["runs"]["using"] == "composite"
    given = {k: str(v) for k, v in inputs.items()}
    for name, meta in spec["inputs"].items():
        if name not in given:
            assert not meta.get("required"), f"input {name} is required"
            given[name] = str(meta.get("default", ""))
    temp = workdir / "runner-temp"
    temp.mkdir(parents=True, exist_ok=True)
    summary = workdir / "step-summary.md"
    summary.touch()
    github_env = workdir / "github-env"
    github_env.touch()
    base = dict(os.environ if env is None else env)
    base.update(
        GITHUB_ACTION_PATH=str(action.parent),
        GITHUB_STEP_SUMMARY=str(summary),
        GITHUB_ENV=str(github_env),
        RUNNER_TEMP=str(temp),
        GITHUB_JOB="test",
        GITHUB_REPOSITORY="example/repo",
        GITHUB_RUN_ID="7",
        GITHUB_RUN_ATTEMPT="1",
    )
    ctx: dict[str, Any] = {"inputs": given, "steps": {}}
    res = Result({}, [], [], "", {}, {}, None, {})
    for n, step in enumerate(spec["runs"]["steps"]):
        name = step.get("name", f"step {n}")
        cond = step.get("if")
        if cond is not None and not Expr(str(cond).removeprefix("${{").removesuffix("}}"), ctx).value():
            continue
        res.ran.append(name)
        if "uses" in step:
            res.uses.append((step["uses"], {k: evaluate(v, ctx) for k, v in step.get("with", {}).items()}))
            continue
        assert step.get("shell") == "bash", f"{name}: composite run steps need shell: bash"
        output = workdir / f"output-{n}"
        output.write_text("")
        step_env = dict(base)
        for line in github_env.read_text().splitlines():  # what earlier steps put in $GITHUB_ENV
            k, _, v = line.partition("=")
            step_env[k] = v
        step_env.update({k: evaluate(v, ctx) for k, v in step.get("env", {}).items()})
        step_env["GITHUB_OUTPUT"] = str(output)
        cwd = Path(evaluate(step.get("working-directory", "."), ctx))
        proc = subprocess.run(
            ["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", step["run"]],
            cwd=workdir / cwd if not cwd.is_absolute() else cwd,
            env=step_env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        res.stdout[name] = proc.stdout
        res.codes[name] = proc.returncode
        outputs = _read_outputs(output)
        if "id" in step:
            ctx["steps"][step["id"]] = {"outputs": outputs}
            res.outputs[step["id"]] = outputs
        if proc.returncode != 0:
            res.failed = name
            break
    res.summary = summary.read_text()
    res.action_outputs = {k: evaluate(v["value"], ctx) for k, v in spec.get("outputs", {}).items()}
    return res
