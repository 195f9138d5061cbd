"""Who is calling, and what may they do.

Credentials are bearer tokens in the `authorization: Bearer <token>` call
metadata (over TLS in production). The tokens file maps the sha256 of each
token (never the token itself) to a tenant and permissions:

    tokens:
      - name: training-job-a          # shown in logs only
        sha256: 9f86d0...             # sha256 hex of the token
        tenant: team-a                # [a-z0-9-]{1,63}
        permissions: [read, publish]  # read: Acquire/Wait/Fetch/DescribeKey/ListArtifacts/Status
                                      # publish: also take compile leases, Publish, Release
                                      # admin: also Purge (take artifacts out of service)
                                      # worker: also report the hits a host's worker
                                      #   answered (ReportHits): the workers' token

Tenants are namespaces: one tenant's keys, leases, artifacts and records are
invisible to another. With allow_unauthenticated, a call without a token is
the tenant "default" with every permission; `compilecast up` uses that on
loopback only.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass

import grpc

from compilecast.config import ConfigError, read_yaml
from compilecast.errors import PermissionDenied, Unauthenticated
from compilecast.grpcutil import token_from

TENANT_RE = re.compile(r"^[a-z0-9-]{1,63}\Z")
PERMISSIONS = {"read", "publish", "admin", "worker"}


@dataclass(frozen=True)
class Principal:
    name: str
    tenant: str
    can_publish: bool  # every identity may read
    can_admin: bool = False
    can_report: bool = False  # a host's worker: ReportHits

    def require_publish(self) -> None:
        if not self.can_publish:
            raise PermissionDenied(f"identity {self.name} may not publish or hold compile leases")

    def require_worker(self) -> None:
        if not self.can_report:
            raise PermissionDenied(f"identity {self.name} may not report hits (needs the "
                                   "worker permission: only hosts' workers report)")

    def require_admin(self) -> None:
        if not self.can_admin:
            raise PermissionDenied(f"identity {self.name} may not purge artifacts "
                                   "(needs the admin permission)")


ANONYMOUS = Principal("anonymous", "default", can_publish=True, can_admin=True,
                      can_report=True)


class Authenticator:
    def __init__(self, by_digest: dict[str, Principal], allow_unauthenticated: bool) -> None:
        self._by_digest = by_digest
        self.allow_unauthenticated = allow_unauthenticated

    @classmethod
    def from_file(cls, path: str, allow_unauthenticated: bool) -> Authenticator:
        if not path:
            if not allow_unauthenticated:
                raise ConfigError("no auth_tokens_file: set one, or allow_unauthenticated "
                                  "explicitly (loopback and tests only)")
            return cls({}, True)
        doc = read_yaml(path, "auth_tokens_file") or {}
        entries = doc.get("tokens") if isinstance(doc, dict) else None
        if not isinstance(entries, list):
            raise ConfigError(f"auth_tokens_file {path} must hold a mapping with a list "
                              "'tokens' of {name, sha256, tenant, permissions}")
        by_digest: dict[str, Principal] = {}
        for i, entry in enumerate(entries):
            where = f"{path}: tokens[{i}]"
            if not isinstance(entry, dict):
                raise ConfigError(f"{where} must be a mapping of name, sha256, tenant, "
                                  "permissions")
            digest = str(entry.get("sha256", "")).lower()
            if not re.fullmatch(r"[0-9a-f]{64}", digest):
                raise ConfigError(f"{where}: sha256 must be 64 hex characters")
            tenant = str(entry.get("tenant", ""))
            if not TENANT_RE.match(tenant):
                raise ConfigError(f"{where}: tenant {tenant!r} must match [a-z0-9-]{{1,63}}")
            perms = entry.get("permissions")
            if not isinstance(perms, list) or not perms \
                    or not all(isinstance(p, str) for p in perms) or set(perms) - PERMISSIONS:
                raise ConfigError(f"{where}: permissions must be a list, a subset of "
                                  f"{sorted(PERMISSIONS)}")
            by_digest[digest] = Principal(str(entry.get("name", f"token-{i}")), tenant,
                                          can_publish="publish" in perms,
                                          can_admin="admin" in perms,
                                          can_report="worker" in perms)
        return cls(by_digest, allow_unauthenticated)

    def identify(self, context: grpc.aio.ServicerContext) -> Principal:
        token = token_from(context)
        if token is None:
            if self.allow_unauthenticated:
                return ANONYMOUS
            raise Unauthenticated("a bearer token is required")
        digest = hashlib.sha256(token.encode()).hexdigest()
        for known, principal in self._by_digest.items():
            if hmac.compare_digest(known, digest):
                return principal
        raise Unauthenticated("unknown token")
