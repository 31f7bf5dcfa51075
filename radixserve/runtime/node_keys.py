"""The secret every node of a multi-node server shares, and the ZeroMQ CURVE keys derived from it
(node_link.py). The secret comes from $RADIXSERVE_DIST_SECRET or the first line of --dist-secret-file, never
from a command line (any local user can read argv). Node 0's sockets are CURVE servers, the other nodes'
clients; both key pairs are a keyed hash of the secret, so every node computes the same ones and nobody without
the secret can: such a peer cannot complete the handshake (it does not know the server key) nor pass the ZAP check
(its client key is not the derived one)."""

from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass
from pathlib import Path

import zmq
from zmq.utils import z85

SECRET_ENV = "RADIXSERVE_DIST_SECRET"
MIN_SECRET_CHARS = 16


def read_secret(args) -> bytes:
    """The first line of --dist-secret-file, else $RADIXSERVE_DIST_SECRET."""
    if args.dist_secret_file is not None:
        try:
            lines = Path(args.dist_secret_file).expanduser().read_text().splitlines()
        except OSError as e:
            raise ValueError(f"cannot read --dist-secret-file {args.dist_secret_file}: {e.strerror or e}") from None
        secret = lines[0].strip() if lines else ""
        where = f"--dist-secret-file {args.dist_secret_file}"
    else:
        secret = os.environ.get(SECRET_ENV, "").strip()
        where = f"${SECRET_ENV}"
    if not secret:
        raise ValueError(
            f"--nnodes > 1 needs a secret shared by every node, to authenticate the links between "
            f"them: set ${SECRET_ENV} or pass --dist-secret-file (e.g. from `openssl rand -hex 32`)"
        )
    if len(secret) < MIN_SECRET_CHARS:
        raise ValueError(f"the secret in {where} is too short: use at least {MIN_SECRET_CHARS} characters")
    return secret.encode()


@dataclass(frozen=True)
class CurveKeys:
    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes


def _keypair(secret: bytes, role: bytes) -> tuple[bytes, bytes]:
    # Any 32 bytes are a Curve25519 secret key; a keyed hash of the shared secret gives every node the same ones.
    secret_key = z85.encode(hmac.new(secret, b"radixserve node link " + role, hashlib.sha256).digest())
    return zmq.curve_public(secret_key), secret_key


def derive_keys(secret: bytes) -> CurveKeys:
    server = _keypair(secret, b"server")
    client = _keypair(secret, b"client")
    return CurveKeys(server[0], server[1], client[0], client[1])


class OnlyOurClient:
    """ZAP credentials check: the one client key derived from the secret."""

    def __init__(self, client_public: bytes):
        self.client_public = client_public

    def callback(self, domain: str, client_key: bytes) -> bool:
        return hmac.compare_digest(client_key, self.client_public)


def curve_server(sock: zmq.Socket, keys: CurveKeys) -> zmq.Socket:
    sock.curve_secretkey, sock.curve_publickey, sock.curve_server = keys.server_secret, keys.server_public, True
    return sock


def curve_client(sock: zmq.Socket, keys: CurveKeys) -> zmq.Socket:
    sock.curve_secretkey, sock.curve_publickey = keys.client_secret, keys.client_public
    sock.curve_serverkey = keys.server_public
    return sock
