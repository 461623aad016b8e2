"""One secured Apache Kafka node for tests: SASL_SSL (SCRAM-SHA-512 and PLAIN), an ACL authorizer, a user per role.

The node has a PLAINTEXT listener (inter-broker, controller and the test's own admin side, where
the ``ANONYMOUS`` principal is a super user: it binds loopback only) and a SASL_SSL listener that
offers SCRAM-SHA-512 and PLAIN, with a server certificate signed by a CA the harness makes in the
test's folder. Every role of :data:`agentstream.infra.acls.ROLES` gets its own user and password, as SCRAM
credentials written at format time and as PLAIN JAAS users; ACLs are granted separately
(:meth:`SecureKafka.grant`), so a test decides what each principal may do.
"""

from __future__ import annotations

import datetime
import ipaddress
import secrets
import subprocess
import time
from dataclasses import dataclass, replace
from pathlib import Path

from confluent_kafka.admin import (
    AclBinding,
    AclBindingFilter,
    AclOperation,
    AclPermissionType,
    AdminClient,
    ResourcePatternType,
)
from confluent_kafka.admin import ResourceType as AdminResourceType
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from agentstream.infra.acls import ROLES, Grant
from agentstream.infra.config import Config, KafkaConfig, Secret
from agentstream.infra.processes import free_port, wait_for_port
from agentstream.stack.kafka import (
    KafkaNode,
    find_java,
    format_storage,
    kafka_command,
    kafka_jars,
    new_cluster_id,
    write_properties,
)

ADMIN = "admin"
LISTENER = "SASL_SSL"
AUTHORIZER = "org.apache.kafka.metadata.authorizer.StandardAuthorizer"


@dataclass(frozen=True)
class Tls:
    """The files of the harness's CA and the broker's certificate (PEM)."""

    ca: Path
    server: Path
    """The server's unencrypted PKCS#8 key followed by its certificate: Kafka's PEM keystore file."""


def make_tls(folder: Path, host: str) -> Tls:
    """A CA and a server certificate for ``host`` (as IP and DNS name), valid for a day."""
    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "agentstream test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = [x509.DNSName("localhost")]
    try:
        names.append(x509.IPAddress(ipaddress.ip_address(host)))
    except ValueError:
        names.append(x509.DNSName(host))
    server = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)]))
              .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
              .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
              .add_extension(x509.SubjectAlternativeName(names), critical=False)
              .sign(ca_key, hashes.SHA256()))
    tls = Tls(folder / "ca.pem", folder / "server.pem")
    tls.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    tls.server.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                             serialization.NoEncryption())
                           + server.public_bytes(serialization.Encoding.PEM))
    return tls


def security_settings(tls: Tls, passwords: dict[str, str]) -> dict[str, str]:
    """server.properties for the SASL_SSL listener: both mechanisms, the PEM keystore, the ACL authorizer."""
    prefix = f"listener.name.{LISTENER.lower()}"
    plain_users = " ".join(f'user_{name}="{password}"' for name, password in passwords.items())
    return {
        "sasl.enabled.mechanisms": "SCRAM-SHA-512,PLAIN",
        f"{prefix}.sasl.enabled.mechanisms": "SCRAM-SHA-512,PLAIN",
        f"{prefix}.scram-sha-512.sasl.jaas.config": "org.apache.kafka.common.security.scram.ScramLoginModule required;",
        f"{prefix}.plain.sasl.jaas.config":
            f"org.apache.kafka.common.security.plain.PlainLoginModule required {plain_users};",
        f"{prefix}.ssl.keystore.type": "PEM",
        f"{prefix}.ssl.keystore.location": str(tls.server),
        "authorizer.class.name": AUTHORIZER,
        "allow.everyone.if.no.acl.found": "false",
        "super.users": f"User:{ADMIN};User:ANONYMOUS",
    }


def _bindings(user: str, grants: list[Grant], kind: type[AclBinding]) -> list:
    """``user``'s ALLOW bindings (or filters matching exactly them) for these grants, on any host."""
    return [kind(AdminResourceType[g.resource.upper()], g.name, ResourcePatternType[g.pattern.upper()], f"User:{user}",
                 "*", AclOperation[g.operation.upper()], AclPermissionType.ALLOW) for g in grants]


class SecureKafka:
    """One KRaft node with SASL_SSL and ACLs, a user per role; ``start`` it, ``stop`` it (by its own PID)."""

    def __init__(self, home: Path, host: str = "127.0.0.1", heap_mb: int = 384) -> None:
        self.home, self.host, self.heap_mb = home, host, heap_mb
        self.passwords = {ADMIN: secrets.token_hex(12), **{role: secrets.token_hex(12) for role in ROLES}}
        self.tls = make_tls(home / "tls", host)
        self.node = KafkaNode(node_id=1, host=host, port=free_port(host), controller_port=free_port(host),
                              log_dir=home / "data", listeners={LISTENER: (free_port(host), LISTENER)},
                              settings=security_settings(self.tls, self.passwords))
        self.log_path = home / "kafka.log"
        self.process: subprocess.Popen | None = None

    @property
    def plaintext(self) -> str:
        """The super-user side (ANONYMOUS on loopback): topics and ACLs are set up through it."""
        return self.node.bootstrap

    @property
    def secure(self) -> str:
        return f"{self.host}:{self.node.listeners[LISTENER][0]}"

    def start(self, timeout_s: float = 90.0) -> SecureKafka:
        java, jars = find_java(), kafka_jars()
        properties = write_properties(self.home / "server.properties", self.node.properties())
        format_storage(java, jars, self.node, properties, new_cluster_id(), scram_users=self.passwords)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(kafka_command(java, jars, properties, self.heap_mb),
                                            stdout=log, stderr=subprocess.STDOUT)
        wait_for_port(self.host, self.node.listeners[LISTENER][0], timeout_s, self.process)
        self._wait_ready(timeout_s)
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        """Until the broker answers metadata on its PLAINTEXT side (the port opens before it serves)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.admin().list_topics(timeout=5)
                return
            except Exception:  # confluent_kafka raises KafkaException until the broker is registered
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def admin(self) -> AdminClient:
        return AdminClient({"bootstrap.servers": self.plaintext})

    def grant(self, user: str, grants: list[Grant]) -> None:
        """Create ACLs allowing ``user`` each grant, on any host; waits for the broker to confirm them."""
        admin = self.admin()  # held until every future is done: a collected client cancels them
        for future in admin.create_acls(_bindings(user, grants, AclBinding)).values():
            future.result(timeout=30)

    def revoke(self, user: str, grants: list[Grant]) -> None:
        """Delete the ACLs that :meth:`grant` made for ``user`` and these grants; waits for the broker to confirm."""
        admin = self.admin()
        for future in admin.delete_acls(_bindings(user, grants, AclBindingFilter)).values():
            future.result(timeout=30)

    def config(self, base: Config, user: str, *, mechanism: str = "SCRAM-SHA-512", password: str | None = None,
               client_id: str | None = None) -> Config:
        """``base`` with ``[kafka]`` set to reach the SASL_SSL listener as ``user`` (its own password by default)."""
        kafka = KafkaConfig(bootstrap_servers=self.secure, security_protocol=LISTENER, sasl_mechanism=mechanism,
                            sasl_username=user, sasl_password=Secret(password or self.passwords[user]),
                            ssl_cafile=str(self.tls.ca), client_id=client_id or f"agentstream-{user}",
                            idempotence=base.kafka.idempotence, fetch_max_wait_ms=base.kafka.fetch_max_wait_ms)
        return replace(base, kafka=kafka)
