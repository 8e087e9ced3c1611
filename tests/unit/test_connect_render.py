"""connect_guard's pure half: the rendered C (snapshot), the LPM tables, and record decoding."""

from __future__ import annotations

import hashlib
import ipaddress
import sys

import pytest

from evidence.agent.recorder.connect_guard import ConnectGuard, main
from evidence.errors import PolicyError
from evidence.policy.connect import (
    ACTION_ALLOW,
    ACTION_DENY,
    RECORD,
    RULE_DEFAULT,
    build_tables,
    decode_record,
    to_denial,
)
from evidence.policy.model import parse_policy
from evidence.probes.render import GUARD_TEMPLATE, GuardConfig, render_guard, template

# Snapshot of the rendered C. When probes/connect_guard.bpf.c changes on purpose, look at the output
# of `python -m evidence.agent.recorder.connect_guard --ebpf` and update these hashes (sha256 of the rendered text).
SNAPSHOT = {
    False: "b7644c41f5d327593fbc95a199cf06916dde471faecf8681db27fde576c1ff11",
    True: "6f5f550112455616dfee139297e2d93bfea6999e64e2b41d33dad25c335f05fb",
}


@pytest.mark.parametrize("dry_run", [False, True])
def test_rendered_c_snapshot(dry_run: bool) -> None:
    text = render_guard(GuardConfig(default_allow=False, dry_run=dry_run, v4_capacity=3, v6_capacity=2))
    assert f"#define DRY_RUN {int(dry_run)}\n" in text
    assert "#define DEFAULT_ALLOW 0\n" in text
    assert "BPF_LPM_TRIE(rules_v4, struct lpm_v4_key, struct rule_set, 3);" in text
    assert "BPF_LPM_TRIE(rules_v6, struct lpm_v6_key, struct rule_set, 2);" in text
    assert "BPF_RINGBUF_OUTPUT(denials, 64);" in text
    for prog in ("guard_connect4", "guard_connect6", "guard_sendmsg4", "guard_sendmsg6"):
        assert f"int {prog}(struct bpf_sock_addr *ctx)" in text
    assert hashlib.sha256(text.encode()).hexdigest() == SNAPSHOT[dry_run]


def test_render_refuses_unfilled_tokens() -> None:
    with pytest.raises(ValueError, match="__NEW_TOKEN__"):
        render_guard(
            GuardConfig(default_allow=True, dry_run=False),
            template(GUARD_TEMPLATE) + "\n#define X __NEW_TOKEN__\n",
        )
    with pytest.raises(ValueError):
        GuardConfig(default_allow=True, dry_run=False, ringbuf_pages=3)


def test_template_uses_only_uapi_context_fields() -> None:
    text = template(GUARD_TEMPLATE)
    import re

    fields = set(re.findall(r"ctx->(\w+)", text))
    assert fields <= {"user_family", "user_ip4", "user_ip6", "user_port", "protocol", "type"}
    assert "bpf_probe_read" not in text and "struct sock " not in text


def test_record_layout_matches_c_struct() -> None:
    assert RECORD.size == 56


POLICY = """\
version: 1
net:
  default: deny
  allow:
    - 10.0.0.0/8
    - 10.1.2.3/32:443
    - udp://10.1.0.0/16:53
    - "[2001:db8::/32]:443"
  deny:
    - 10.1.0.0/16
    - "2001:db8::1"
"""


def test_tables_copy_covering_rules_most_specific_first() -> None:
    net = parse_policy(POLICY, name="p", variables={}).net
    assert net is not None
    v4, v6 = build_tables(net)

    def key(cidr: str) -> tuple[bytes, int]:
        net = ipaddress.ip_network(cidr)
        return net.network_address.packed, net.prefixlen

    labels = net.labels()
    assert labels == [
        "net.allow[0]: 10.0.0.0/8",
        "net.allow[1]: 10.1.2.3/32:443",
        "net.allow[2]: udp://10.1.0.0/16:53",
        "net.allow[3]: [2001:db8::/32]:443",
        "net.deny[0]: 10.1.0.0/16",
        "net.deny[1]: 2001:db8::1",
    ]
    assert v4[key("10.0.0.0/8")] == [(0, 0, ACTION_ALLOW, 0)]
    # /16: the udp port-53 allow (more specific than the plain /16 deny at the same length), then the deny, then the /8
    assert v4[key("10.1.0.0/16")] == [
        (53, 17, ACTION_ALLOW, 2),
        (0, 0, ACTION_DENY, 4),
        (0, 0, ACTION_ALLOW, 0),
    ]
    assert v4[key("10.1.2.3/32")] == [
        (443, 0, ACTION_ALLOW, 1),
        (53, 17, ACTION_ALLOW, 2),
        (0, 0, ACTION_DENY, 4),
        (0, 0, ACTION_ALLOW, 0),
    ]
    assert v6[key("2001:db8::1/128")] == [(0, 0, ACTION_DENY, 5), (443, 0, ACTION_ALLOW, 3)]
    assert v6[key("2001:db8::/32")] == [(443, 0, ACTION_ALLOW, 3)]


def _first_match(entries: list[tuple[int, int, int, int]], port: int, proto: int) -> int | None:
    """What the C `decide` loop does with a rule set."""
    for p, pr, action, rid in entries:
        if (p and p != port) or (pr and pr != proto):
            continue
        return rid if action == ACTION_DENY else -1
    return None


@pytest.mark.parametrize(
    ("addr", "port", "proto"),
    [
        ("10.1.2.3", 443, 6),
        ("10.1.2.3", 80, 6),
        ("10.1.9.9", 53, 17),
        ("10.1.9.9", 53, 6),
        ("10.200.0.1", 1, 6),
        ("11.0.0.1", 1, 6),
        ("2001:db8::1", 443, 6),
        ("2001:db8::2", 443, 6),
        ("2001:db8::2", 80, 6),
    ],
)
def test_tables_decide_like_check_connect(addr: str, port: int, proto: int) -> None:
    policy = parse_policy(POLICY, name="p", variables={})
    assert policy.net is not None
    v4, v6 = build_tables(policy.net)
    ip = ipaddress.ip_address(addr)
    table = v4 if ip.version == 4 else v6
    # longest prefix match, as the kernel's LPM trie does
    match = max(
        (k for k in table if ip in ipaddress.ip_network((k[0], k[1]))), key=lambda k: k[1], default=None
    )
    result = _first_match(table[match], port, proto) if match else None
    labels = policy.net.labels()
    kernel = None if result == -1 else ("net.default: deny" if result is None else labels[result])
    expected = policy.check_connect(
        "AF_INET" if ip.version == 4 else "AF_INET6", addr, port, "udp" if proto == 17 else "tcp"
    )
    assert kernel == (expected.rule if expected else None)


def test_too_many_rules_for_one_prefix() -> None:
    allow = "".join(f"    - 10.0.0.1:{1000 + i}\n" for i in range(5))
    net = parse_policy("version: 1\nnet:\n  default: deny\n  allow:\n" + allow, name="p", variables={}).net
    assert net is not None
    with pytest.raises(PolicyError, match="at most 4"):
        build_tables(net, max_entries=4)


# Saved raw records (little-endian, as the kernel wrote them) beside the decoded records.
RAW_MAPPED = bytes.fromhex(
    "15cd5b0700000000bb01000000000000921000009310000001000000822306060101010000000000000000000000ffff0a01020300000000"
)
RAW_UDP = bytes.fromhex(
    "050000000000000007000000000000000a0000000b000000ffffffff3500041102000000c000020100000000000000000000000000000000"
)


@pytest.mark.skipif(sys.byteorder != "little", reason="saved records are little-endian")
def test_decode_saved_records() -> None:
    labels = ["net.allow[0]: 10.0.0.0/8", "net.deny[0]: 10.0.0.0/8:9090"]
    rec = decode_record(RAW_MAPPED)
    assert (rec.cgroup_id, rec.tgid, rec.tid, rec.protocol, rec.mapped) == (443, 4242, 4243, 6, True)
    assert to_denial(rec, labels, "deny", 1_000) == {
        "k": "denial",
        "t": 123456789 + 1_000,
        "pid": 4242,
        "exe": None,
        "operation": "connect",
        "target": "[::ffff:10.1.2.3]:9090",
        "rule": "net.deny[0]: 10.0.0.0/8:9090",
        "enforced": True,
        "result": "EPERM",
    }
    rec = decode_record(RAW_UDP)
    assert rec.rule_id == RULE_DEFAULT
    assert to_denial(rec, labels, "deny", 0) == {
        "k": "denial",
        "t": 5,
        "pid": 10,
        "exe": None,
        "operation": "sendmsg",
        "target": "192.0.2.1:53",
        "rule": "net.default: deny",
        "enforced": False,
        "result": 0,
    }
    with pytest.raises(ValueError):
        decode_record(RAW_UDP[:20])


def test_denial_records_fit_the_bundle_model() -> None:
    from evidence.bundle.format import PolicyDenial

    rec = to_denial(decode_record(RAW_MAPPED), [], "deny", 0)
    PolicyDenial(**{k: v for k, v in rec.items() if k not in ("k", "t")})


def test_guard_without_net_policy_is_default_allow_and_loads_nothing() -> None:
    guard = ConnectGuard(None, dry_run=True)
    assert guard.config.default_allow and guard.labels == []
    assert guard.poll(0) == [] and guard.lost == 0
    guard.detach()  # not attached: nothing to do


def test_ebpf_printing(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--ebpf", "--dry-run"]) == 0
    assert "#define DRY_RUN 1" in capsys.readouterr().out
