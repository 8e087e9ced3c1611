"""`evidence agent`: run the recording daemon (sidecar or DaemonSet); see agent/daemon/service.py."""

from __future__ import annotations

import argparse
import logging
import os

from evidence.errors import SetupError


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--socket", metavar="PATH", help="Unix socket of the control API")
    p.add_argument("--bundle-dir", metavar="DIR", help="where bundles are written")
    p.add_argument(
        "--kubernetes",
        action="store_true",
        default=None,
        help="find pods under the kubepods cgroups and record one run per pod",
    )
    p.add_argument("--config", metavar="FILE", help="YAML settings file (see docs/deploy.md)")


def run(args: argparse.Namespace) -> int:
    from evidence.errors import require_agent_extra

    require_agent_extra("agent")
    from evidence.agent.daemon.settings import load_settings

    settings = load_settings(
        args.config,
        overrides={"socket": args.socket, "bundle_dir": args.bundle_dir, "kubernetes": args.kubernetes},
    )
    if os.geteuid() != 0:
        raise SetupError("evidence agent needs root (BPF, cgroups, /proc of other users)", "run it as root")
    if not args.verbose and not os.environ.get("EVIDENCE_LOG"):
        for name in ("evidence.agent", "evidence.bundle", "evidence.probes"):
            logging.getLogger(name).setLevel(logging.INFO)
    from evidence.agent.daemon.service import Daemon

    return Daemon(settings).run()
