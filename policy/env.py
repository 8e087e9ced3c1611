"""Environment scrubbing: remove secret-looking variables and, when asked, execution-influence ones.

Names are matched case-insensitively against shell-style globs. `policy_env.allow` wins over every
pattern; `policy_env.strip` adds patterns. Only names are reported, never values.
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Iterable, Mapping

from evidence.policy.model import EnvPolicy

logger = logging.getLogger(__name__)

SECRET_PATTERNS: tuple[str, ...] = (
    "*_TOKEN",
    "*_TOKEN_*",
    "TOKEN",
    "*SECRET*",
    "*PASSWORD*",
    "*PASSWD*",
    "*_PASS",
    "*_KEY",
    "*_KEY_ID",
    "*_APIKEY",
    "*_API_KEY",
    "*PRIVATE_KEY*",
    "*CREDENTIAL*",
    "*_AUTH",
    "*_AUTH_TOKEN",
    "*_PAT",
    "*_SESSION",
    "*_COOKIE",
    "*_DSN",
    "AWS_*",
    "GITHUB_*",
    "GH_*",
    "ACTIONS_*",
    "SSH_*",
    "GPG_*",
    "AZURE_*",
    "ARM_CLIENT_*",
    "GOOGLE_APPLICATION_CREDENTIALS",
    "GCP_*",
    "CLOUDSDK_*",
    "VAULT_*",
    "DOCKER_AUTH_CONFIG",
    "KUBECONFIG",
    "NPM_CONFIG__AUTH*",
    "NETRC",
    "CI_JOB_JWT*",
    "CI_REGISTRY_PASSWORD",
)

EXEC_INFLUENCE_PATTERNS: tuple[str, ...] = (
    "LD_*",
    "DYLD_*",
    "GCONV_PATH",
    "GLIBC_TUNABLES",
    "LOCPATH",
    "NLSPATH",
    "MALLOC_*",
    "HOSTALIASES",
    "RES_OPTIONS",
    "PYTHON*",
    "NODE_OPTIONS",
    "NODE_PATH",
    "NODE_REPL_EXTERNAL_MODULE",
    "BASH_ENV",
    "ENV",
    "BASH_FUNC_*",
    "SHELLOPTS",
    "BASHOPTS",
    "PROMPT_COMMAND",
    "PS4",
    "IFS",
    "CDPATH",
    "PERL5LIB",
    "PERL5OPT",
    "PERLLIB",
    "PERL5DB",
    "RUBYOPT",
    "RUBYLIB",
    "GEM_PATH",
    "JAVA_TOOL_OPTIONS",
    "_JAVA_OPTIONS",
    "JDK_JAVA_OPTIONS",
    "CLASSPATH",
    "GIT_SSH",
    "GIT_SSH_COMMAND",
    "GIT_EXEC_PATH",
    "GIT_CONFIG_*",
    "GIT_ASKPASS",
    "SSH_ASKPASS",
    "EDITOR",
    "VISUAL",
    "PAGER",
    "BROWSER",
    "LESSOPEN",
    "LESSCLOSE",
)


def _matches(name: str, patterns: Iterable[str]) -> bool:
    upper = name.upper()
    return any(fnmatch.fnmatchcase(upper, p.upper()) for p in patterns)


def is_secret_name(name: str) -> bool:
    return _matches(name, SECRET_PATTERNS)


def is_exec_influence_name(name: str) -> bool:
    return _matches(name, EXEC_INFLUENCE_PATTERNS)


def scrub(environ: Mapping[str, str], policy_env: EnvPolicy | None) -> tuple[dict[str, str], list[str]]:
    """(new environment, removed names sorted). None means the defaults (strip secrets only)."""
    pe = policy_env if policy_env is not None else EnvPolicy()
    patterns: list[str] = list(pe.strip)
    if pe.strip_secrets:
        patterns += SECRET_PATTERNS
    if pe.strip_exec_influence:
        patterns += EXEC_INFLUENCE_PATTERNS
    kept: dict[str, str] = {}
    removed: list[str] = []
    for name, value in environ.items():
        if not _matches(name, pe.allow) and _matches(name, patterns):
            removed.append(name)
        else:
            kept[name] = value
    removed.sort()
    if removed:
        logger.info("environment: removed %d variables: %s", len(removed), ", ".join(removed))
    return kept, removed
