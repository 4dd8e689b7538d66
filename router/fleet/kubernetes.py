"""`[[discovery]]` kind "kubernetes": the ready pods of a label selector, read from the
Kubernetes API with plain HTTP (no client library): `GET /api/v1/namespaces/{ns}/pods
?labelSelector=...` with the pod's service-account token (re-read every round: projected
tokens rotate) and the cluster CA. The router's service account needs `get` and `list`
on pods in that namespace (deploy/ has the Role).

A pod counts once it is Running, its Ready condition is True, it is not being deleted and
it has an IP: the same pods a Service would send traffic to.
"""

from __future__ import annotations

import ipaddress
import os
import ssl
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from router.config.schema import SERVICE_ACCOUNT, BackendConfig, DiscoveryConfig
from router.fleet.lookup import LookupFailed, backend_for

_TIMEOUT_S = 5.0


def ready_pods(pod_list: dict[str, Any]) -> list[tuple[str, str]]:
    """(pod name, pod IP) of every pod a Service would route to, from a PodList."""
    out = []
    for pod in pod_list.get("items") or []:
        meta, status = pod.get("metadata") or {}, pod.get("status") or {}
        if meta.get("deletionTimestamp") or status.get("phase") != "Running":
            continue
        conditions = {c.get("type"): c.get("status") for c in status.get("conditions") or []}
        ip = status.get("podIP")
        if conditions.get("Ready") != "True" or not ip:
            continue
        try:
            ipaddress.ip_address(ip)
        except ValueError:
            continue
        out.append((str(meta.get("name", "pod")), ip))
    return sorted(out)


class KubernetesLookup:
    def __init__(self, d: DiscoveryConfig, environ: dict[str, str] | None = None):
        self.d = d
        self.env = os.environ if environ is None else environ
        self.api = d.api_server.rstrip("/")
        self.namespace = d.namespace or _own_namespace()

    def _ssl(self) -> ssl.SSLContext | bool:
        if not self.api.startswith("https://"):
            return False
        return ssl.create_default_context(cafile=self.d.ca_file if Path(self.d.ca_file).exists() else None)

    def _headers(self) -> dict[str, str]:
        try:
            token = Path(self.d.token_file).read_text().strip()
        except OSError:
            return {}  # an API server that needs no token (a local proxy, `kubectl proxy`)
        return {"Authorization": f"Bearer {token}"} if token else {}

    async def __call__(self) -> dict[str, BackendConfig]:
        if not self.api:
            self.api = _in_cluster_api(self.env)
        url = f"{self.api}/api/v1/namespaces/{self.namespace}/pods"
        timeout = aiohttp.ClientTimeout(total=_TIMEOUT_S)
        try:
            async with (
                aiohttp.ClientSession(timeout=timeout) as s,
                s.get(
                    url, params={"labelSelector": self.d.label_selector}, headers=self._headers(), ssl=self._ssl()
                ) as r,
            ):
                body = await r.read()
                if r.status != 200:
                    raise LookupFailed(f"{url} answered HTTP {r.status}: {body[:200]!r}")
        except aiohttp.ClientError as e:
            raise LookupFailed(f"{url}: {type(e).__name__}: {e}") from None
        try:
            pod_list = orjson.loads(body)
        except orjson.JSONDecodeError:
            raise LookupFailed(f"{url}: the answer is not JSON") from None
        if not isinstance(pod_list, dict) or pod_list.get("kind") != "PodList":
            raise LookupFailed(f"{url}: expected a PodList")
        return {b.name: b for b in (backend_for(self.d, ip, name) for name, ip in ready_pods(pod_list))}


def _in_cluster_api(env: Mapping[str, str]) -> str:
    host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT", "443")
    if not host:
        raise LookupFailed("not in a Kubernetes pod (KUBERNETES_SERVICE_HOST is unset): set discovery.api_server")
    return f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"


def _own_namespace() -> str:
    try:
        return Path(f"{SERVICE_ACCOUNT}/namespace").read_text().strip() or "default"
    except OSError:
        return "default"
