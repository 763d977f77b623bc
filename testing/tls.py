"""Certificates for tests, made on the spot with ``cryptography`` (a dev dependency): a CA,
a server certificate for 127.0.0.1 / localhost, a client certificate from the same CA, and a
client certificate from a second CA that the server does not trust."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path


def make_tls_files(directory: Path) -> dict[str, str]:
    """PEM files in ``directory``; returns their paths by name: ca, server_cert, server_key,
    client_cert, client_key, rogue_cert, rogue_key."""
    ca_key, ca_cert = _certificate("kvserve test CA", ca=True)
    server_key, server_cert = _certificate("127.0.0.1", issuer=(ca_key, ca_cert), server=True)
    client_key, client_cert = _certificate("kvserve test client", issuer=(ca_key, ca_cert))
    rogue_ca = _certificate("another CA", ca=True)
    rogue_key, rogue_cert = _certificate("kvserve rogue client", issuer=rogue_ca)
    files = {
        "ca": _pem(ca_cert), "server_cert": _pem(server_cert), "server_key": _pem(server_key),
        "client_cert": _pem(client_cert), "client_key": _pem(client_key),
        "rogue_cert": _pem(rogue_cert), "rogue_key": _pem(rogue_key),
    }
    paths = {}
    for name, data in files.items():
        path = directory / f"{name}.pem"
        path.write_bytes(data)
        paths[name] = str(path)
    return paths


def _certificate(name: str, issuer=None, ca: bool = False, server: bool = False):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    issuer_key, issuer_cert = issuer if issuer else (key, None)
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer_cert.subject if issuer_cert else subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if server:
        names = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return key, builder.sign(issuer_key, hashes.SHA256())


def _pem(obj) -> bytes:
    from cryptography.hazmat.primitives import serialization

    if hasattr(obj, "private_bytes"):
        return obj.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())
    return obj.public_bytes(serialization.Encoding.PEM)
