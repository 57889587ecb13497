"""TLS material of the control service: a private CA and the service's certificate, and their
fingerprints.

    python -m rayzero.control_api.tls --out DIR [--name NAME]     # ca.crt, tls.crt, tls.key in DIR

[Note: control-plane TLS]
The service's certificate is signed by a CA made for it alone (the Kubernetes operator makes one
per attempt of a RayZeroJob, in the job's Secret; outside Kubernetes `python -m rayzero.control_api.tls`
makes one). The CA's private key is thrown away once it has signed: it can vouch for nothing else.
Clients trust that one CA and no other (not the system's roots): the operator reads it from the
job's Secret, pods and users pass it as RAYZERO_CONTROL_TLS_CA / `--ca-file`. The certificate names
the service by a DNS name that is an identity, not an address (`control.<job>.<namespace>.rayzero`
in Kubernetes): clients reach the service by IP or Service name and verify that name
(`grpc.ssl_target_name_override`), so the certificate does not have to know the pod's address.
`control.json` records the CA's SHA-256 fingerprint (and the CA itself, which is public) so a
client holding its own copy of the CA learns before sending the token whether it is this run's.

`cryptography` (pyca) builds and reads the certificates: the standard Python X.509 library, already
a dependency of Ray's (through google-auth); the fingerprints need only the standard library.
"""
from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import os
import re
import ssl
import sys
from dataclasses import dataclass
from pathlib import Path

from rayzero.config.errors import RayZeroValueError

DEFAULT_SERVER_NAME = "rayzero-control"
VALID_DAYS = 3650
"""Ten years (kubeadm's CA lifetime): a run may be suspended for months; what limits exposure is that
the CA signs one certificate and is replaced with every attempt, not its expiry."""
CA_FILE, CERT_FILE, KEY_FILE = "ca.crt", "tls.crt", "tls.key"
_PEM_CERTIFICATE = re.compile(r"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", re.DOTALL)


@dataclass(frozen=True)
class ServiceCertificates:
    """PEM texts: the CA certificate clients trust, and the service's certificate and key."""

    ca_certificate: str
    certificate: str
    """The service's certificate followed by the CA's (the chain the server presents)."""
    private_key: str


def make_service_certificates(server_name: str, valid_days: int = VALID_DAYS) -> ServiceCertificates:
    """A fresh CA (key discarded after signing) and a certificate for `server_name` it signed."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = dt.datetime.now(dt.timezone.utc)
    start, end = now - dt.timedelta(minutes=5), now + dt.timedelta(days=valid_days)  # 5 min: clock skew
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"rayzero control CA for {server_name}"[:64])])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                       crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    leaf = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, server_name[:64])]))
            .issuer_name(ca_name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(server_name)]), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    del ca_key  # never stored: this CA signs nothing else
    ca_pem = ca.public_bytes(serialization.Encoding.PEM).decode()
    return ServiceCertificates(
        ca_certificate=ca_pem,
        certificate=leaf.public_bytes(serialization.Encoding.PEM).decode() + ca_pem,
        private_key=key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption()).decode())


def all_certificates(pem: str) -> list[str]:
    """Each PEM certificate of a chain, in order."""
    return [found + "\n" for found in _PEM_CERTIFICATE.findall(pem)]


def first_certificate(pem: str) -> str:
    certificates = all_certificates(pem)
    if not certificates:
        raise RayZeroValueError("no PEM certificate (-----BEGIN CERTIFICATE-----) in the text given")
    return certificates[0]


def fingerprint(pem: str) -> str:
    """`sha256:<hex>` of the first certificate's DER bytes (what `openssl x509 -fingerprint -sha256`
    prints, without the colons; kubeadm's `--discovery-token-ca-cert-hash` style)."""
    return "sha256:" + hashlib.sha256(ssl.PEM_cert_to_DER_cert(first_certificate(pem))).hexdigest()


def dns_names(pem: str) -> list[str]:
    """The DNS names of the first certificate's subjectAltName (empty when it has none)."""
    from cryptography import x509

    certificate = x509.load_pem_x509_certificate(first_certificate(pem).encode())
    try:
        names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return list(names.get_values_for_type(x509.DNSName))


def write_private_file(path: Path, text: str, mode: int = 0o600) -> None:
    """Create `path` with `mode` from the first byte; never through a symlink, never over a file."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    with os.fdopen(descriptor, "w") as handle:
        handle.write(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m rayzero.control_api.tls",
        description="Make a private CA and a certificate for a run's control service. Then start the run "
                    "with RAYZERO_CONTROL_TLS_CERT=DIR/tls.crt RAYZERO_CONTROL_TLS_KEY=DIR/tls.key, and give "
                    "clients RAYZERO_CONTROL_TLS_CA=DIR/ca.crt (or `rayzero status --ca-file DIR/ca.crt`).")
    parser.add_argument("--out", required=True, help="directory to create ca.crt, tls.crt, tls.key in (must not "
                                                     "hold them already)")
    parser.add_argument("--name", default=DEFAULT_SERVER_NAME,
                        help=f"the DNS name the certificate vouches for (default {DEFAULT_SERVER_NAME}); clients "
                             "verify it whatever address they connect to")
    parser.add_argument("--days", type=int, default=VALID_DAYS, help=f"validity (default {VALID_DAYS})")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True, mode=0o700)
    taken = [str(out / name) for name in (KEY_FILE, CERT_FILE, CA_FILE) if os.path.lexists(out / name)]
    if taken:
        print(f"{', '.join(taken)} exist(s): choose another --out directory (nothing was overwritten)",
              file=sys.stderr)
        return 2
    made = make_service_certificates(args.name, args.days)
    write_private_file(out / KEY_FILE, made.private_key)
    write_private_file(out / CERT_FILE, made.certificate, 0o644)
    write_private_file(out / CA_FILE, made.ca_certificate, 0o644)
    print(f"wrote {out / CA_FILE}, {out / CERT_FILE}, {out / KEY_FILE} (0600) for {args.name}; "
          f"CA fingerprint {fingerprint(made.ca_certificate)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
