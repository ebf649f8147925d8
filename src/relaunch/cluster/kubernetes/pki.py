"""A control plane's certificates and kubeconfigs, made per cluster (the `cryptography` library).

One certificate authority signs the API server's serving certificate and a client certificate
per identity; Kubernetes reads a client certificate's common name as the user and its
organisations as the groups. The identities are the control plane's own
(`system:kube-controller-manager`, `system:kube-scheduler`), an administrator
(`system:masters`, for the trial's setup and for a person), relaunch's controller
(`relaunch:controller`, bound by RBAC to what it uses) and each node's agent
(`system:node:NAME` in `system:nodes`: the Node authorizer and NodeRestriction give it its own
Node, its Lease and the Pods bound to it, nothing more). Keys are ECDSA P-256: small and quick
to make, accepted everywhere Kubernetes takes a key.
"""

from __future__ import annotations

import base64
import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["Identity", "Pki", "kubeconfig"]

VALID = datetime.timedelta(days=365)
SERVICE_IP = "10.0.0.1"
"""The `kubernetes` Service's address: the first of the service range the API server is given."""
API_NAMES = (
    "localhost",
    "kubernetes",
    "kubernetes.default",
    "kubernetes.default.svc",
    "kubernetes.default.svc.cluster.local",
)


@dataclass(frozen=True)
class Identity:
    """Who a client certificate says it is: a user and its groups."""

    user: str
    groups: tuple[str, ...] = ()

    @property
    def file_name(self) -> str:
        return self.user.replace(":", "-")


ADMIN = Identity("relaunch-admin", ("system:masters",))
CONTROLLER_MANAGER = Identity("system:kube-controller-manager")
SCHEDULER = Identity("system:kube-scheduler")
CONTROLLER = Identity("relaunch:controller", ("relaunch:controllers",))


def node_identity(node: str) -> Identity:
    """A node agent's identity, as the Node authorizer knows a kubelet's."""
    return Identity(f"system:node:{node}", ("system:nodes",))


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _name(common: str, organisations: tuple[str, ...] = ()) -> x509.Name:
    parts = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in organisations]
    return x509.Name([*parts, x509.NameAttribute(NameOID.COMMON_NAME, common)])


class Pki:
    """The certificates of one cluster, kept in `directory` (made at the first `ensure`)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.ca_cert = directory / "ca.crt"
        self.ca_key = directory / "ca.key"
        self.service_account_key = directory / "service-account.key"
        self.service_account_pub = directory / "service-account.pub"
        self.serving_cert = directory / "apiserver.crt"
        self.serving_key = directory / "apiserver.key"

    def ensure(self) -> None:
        """The authority, the API server's serving pair and the service accounts' signing key."""
        self.directory.mkdir(parents=True, exist_ok=True)
        if not self.ca_cert.exists():
            key = _key()
            now = datetime.datetime.now(datetime.UTC)
            name = _name("relaunch-trial-ca")
            cert = (
                x509.CertificateBuilder()
                .subject_name(name)
                .issuer_name(name)
                .public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + VALID)
                .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                .add_extension(
                    x509.KeyUsage(False, False, False, False, False, True, True, False, False),
                    critical=True,
                )
                .sign(key, hashes.SHA256())
            )
            self._write(self.ca_key, _pem_key(key))
            self.ca_cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        if not self.serving_cert.exists():
            sans: list[x509.GeneralName] = [x509.DNSName(n) for n in API_NAMES]
            sans += [x509.IPAddress(ipaddress.ip_address(a)) for a in ("127.0.0.1", SERVICE_IP)]
            cert_pem, key_pem = self._signed(_name("kube-apiserver"), sans, server=True)
            self._write(self.serving_key, key_pem)
            self.serving_cert.write_bytes(cert_pem)
        if not self.service_account_key.exists():
            key = _key()
            self._write(self.service_account_key, _pem_key(key))
            self.service_account_pub.write_bytes(
                key.public_key().public_bytes(
                    serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
                )
            )

    def client(self, identity: Identity) -> tuple[bytes, bytes]:
        """A client certificate and its key (PEM) for `identity`."""
        return self._signed(_name(identity.user, identity.groups), [], server=False)

    def _signed(
        self, subject: x509.Name, sans: list[x509.GeneralName], *, server: bool
    ) -> tuple[bytes, bytes]:
        ca_key = serialization.load_pem_private_key(self.ca_key.read_bytes(), password=None)
        assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
        ca = x509.load_pem_x509_certificate(self.ca_cert.read_bytes())
        key = _key()
        now = datetime.datetime.now(datetime.UTC)
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(ca.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + VALID)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(ca_key, hashes.SHA256())
        return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)

    @staticmethod
    def _write(path: Path, data: bytes) -> None:
        path.touch(mode=0o600)
        path.write_bytes(data)


def kubeconfig(pki: Pki, server: str, identity: Identity, path: Path) -> Path:
    """A kubeconfig at `path` for `identity` on the API server at `server` (its certificates
    inline, so that the file alone is the credential; mode 0600)."""
    cert, key = pki.client(identity)
    encoded = {
        "certificate-authority-data": pki.ca_cert.read_bytes(),
        "client-certificate-data": cert,
        "client-key-data": key,
    }
    data = {k: base64.b64encode(v).decode() for k, v in encoded.items()}
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "relaunch-trial",
                "cluster": {
                    "server": server,
                    "certificate-authority-data": data["certificate-authority-data"],
                },
            }
        ],
        "users": [
            {
                "name": identity.user,
                "user": {
                    "client-certificate-data": data["client-certificate-data"],
                    "client-key-data": data["client-key-data"],
                },
            }
        ],
        "contexts": [
            {
                "name": "relaunch-trial",
                "context": {"cluster": "relaunch-trial", "user": identity.user},
            }
        ],
        "current-context": "relaunch-trial",
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch(mode=0o600)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path
