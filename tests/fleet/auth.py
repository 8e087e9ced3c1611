"""TLS certificates and NATS JWT credentials made by the tests themselves, for real nats-servers on
loopback: a CA and a server certificate for 127.0.0.1 (`cryptography`); an operator, an account with
JetStream and a user, as the JWTs nats-server checks in operator mode, and the user's `.creds` file
(`nkeys` signs them: header `ed25519-nkey`, as nsc makes them)."""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import ipaddress
import json
import os
import time
from pathlib import Path
from typing import Any

import nkeys
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

# --- TLS ---------------------------------------------------------------------------------------------


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> Path:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    path.chmod(0o600)
    return path


def make_ca(tmp: Path, name: str) -> tuple[Path, ec.EllipticCurvePrivateKey, x509.Certificate]:
    """(the CA's certificate file, its key, its certificate)."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(name))
        .issuer_name(_name(name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    path = tmp / f"{name}.pem"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path, key, cert


def server_cert(tmp: Path, ca_key: ec.EllipticCurvePrivateKey, ca: x509.Certificate) -> tuple[Path, Path]:
    """(certificate file, key file) of a server at 127.0.0.1 and localhost, signed by the CA."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("nats-test"))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
            ),
            critical=False,
        )
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    cert_path = tmp / "server.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert_path, _write_key(key, tmp / "server.key")


def tls_config(cert: Path, key: Path) -> str:
    return f'tls {{ cert_file: "{cert}", key_file: "{key}", timeout: 5 }}\n'


# --- JWTs --------------------------------------------------------------------------------------------


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _jwt(issuer: nkeys.KeyPair, subject: str, name: str, nats: dict[str, Any]) -> str:
    claims: dict[str, Any] = {
        "iat": int(time.time()),
        "iss": issuer.public_key.decode(),
        "name": name,
        "sub": subject,
        "nats": {**nats, "version": 2},
    }
    claims["jti"] = (
        base64.b32encode(hashlib.sha256(json.dumps(claims).encode()).digest()).decode().rstrip("=")
    )
    head = _b64(json.dumps({"typ": "JWT", "alg": "ed25519-nkey"}).encode())
    body = _b64(json.dumps(claims).encode())
    sig = issuer.sign(f"{head}.{body}".encode())
    return f"{head}.{body}.{_b64(sig)}"


def _key(prefix: int) -> nkeys.KeyPair:
    return nkeys.from_seed(nkeys.encode_seed(os.urandom(32), prefix))


class Operator:
    """An operator and one account with JetStream: the server's configuration (`config`), and
    `.creds` files of users of that account (`creds`)."""

    def __init__(self) -> None:
        self.operator = _key(nkeys.PREFIX_BYTE_OPERATOR)
        self.account = _key(nkeys.PREFIX_BYTE_ACCOUNT)
        self.system = _key(nkeys.PREFIX_BYTE_ACCOUNT)  # JetStream needs the server's system account
        op_pub = self.operator.public_key.decode()
        self.system_pub = self.system.public_key.decode()
        self.operator_jwt = _jwt(
            self.operator, op_pub, "evidence-test", {"type": "operator", "system_account": self.system_pub}
        )
        self.system_jwt = _jwt(self.operator, self.system_pub, "SYS", {"type": "account"})
        limits = {"subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1, "wildcards": True,
                  "conn": -1, "leaf": -1, "mem_storage": -1, "disk_storage": -1, "streams": -1,
                  "consumer": -1}  # fmt: skip
        self.account_pub = self.account.public_key.decode()
        self.account_jwt = _jwt(
            self.operator, self.account_pub, "fleet", {"type": "account", "limits": limits}
        )

    def config(self) -> str:
        return (
            f'operator: "{self.operator_jwt}"\n'
            "resolver: MEMORY\n"
            f'system_account: "{self.system_pub}"\n'
            f'resolver_preload: {{ {self.account_pub}: "{self.account_jwt}", {self.system_pub}: "{self.system_jwt}" }}\n'
        )

    def creds(self, path: Path, name: str, signer: nkeys.KeyPair | None = None) -> Path:
        """A user's `.creds` file (its JWT, issued by the account, or by `signer`; then its seed)."""
        user_seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
        user = nkeys.from_seed(user_seed)
        limits = {"pub": {}, "sub": {}, "subs": -1, "data": -1, "payload": -1}
        jwt = _jwt(signer or self.account, user.public_key.decode(), name, {"type": "user", **limits})
        path.write_text(
            "-----BEGIN NATS USER JWT-----\n"
            f"{jwt}\n"
            "------END NATS USER JWT------\n\n"
            "************************* IMPORTANT *************************\n"
            "NKEY Seed printed below can be used to sign and prove identity.\n\n"
            "-----BEGIN USER NKEY SEED-----\n"
            f"{user_seed.decode()}\n"
            "------END USER NKEY SEED------\n"
        )
        path.chmod(0o600)
        return path
