"""deploy/kubernetes: every object validated against the Kubernetes API schemas
(kubernetes-validate, strict: unknown fields are errors), and the pieces checked against
each other and against the router itself: the ConfigMap's router.toml is a valid
configuration with the Secret's values in the environment, its discovery names are the
engines' headless Services, probes, selectors and ports line up."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from router.config.overrides import layer
from router.config.parse import parse_config

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "kubernetes"
# The oldest Kubernetes minor still commonly run, and the newest the validator knows.
VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
NAMESPACE = "cachehit"

# ServiceMonitor is a Prometheus Operator custom resource: kubernetes-validate has no schema
# for it. These are the fields of its CRD (monitoring.coreos.com/v1) that the manifest uses.
SERVICE_MONITOR_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "endpoints"],
            "properties": {
                "selector": {
                    "type": "object",
                    "properties": {"matchLabels": {"type": "object", "additionalProperties": {"type": "string"}}},
                },
                "namespaceSelector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "any": {"type": "boolean"},
                        "matchNames": {"type": "array", "items": {"type": "string"}},
                    },
                },
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string"},
                            "interval": {
                                "type": "string",
                                "pattern": "^(0|(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$",
                            },
                            "scheme": {"enum": ["http", "https"]},
                        },
                    },
                },
            },
        },
    },
}


def documents() -> list[dict[str, Any]]:
    docs = []
    for f in sorted(DEPLOY.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(f.read_text()) if d]
    return docs


def find(kind: str, name: str) -> dict[str, Any]:
    matches = [d for d in documents() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}: {len(matches)} objects"
    return matches[0]


@pytest.mark.parametrize("version", VERSIONS)
def test_every_object_is_valid_for_the_kubernetes_api(version: str) -> None:
    docs = documents()
    kinds = {d["kind"] for d in docs}
    assert {
        "Namespace",
        "ConfigMap",
        "Secret",
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "ServiceMonitor",
        "ServiceAccount",
        "Role",
        "RoleBinding",
    } <= kinds
    for d in docs:
        if d["kind"] == "ServiceMonitor":
            jsonschema.validate(d, SERVICE_MONITOR_SCHEMA)
        else:
            kubernetes_validate.validate(d, version, strict=True)
        if d["kind"] != "Namespace":
            assert d["metadata"]["namespace"] == NAMESPACE, d["metadata"]["name"]


def test_the_validator_catches_a_wrong_manifest() -> None:
    # The schemas are really applied: a misspelt field and a wrong type both fail.
    bad = find("Deployment", "cachehit-router")
    bad = {**bad, "spec": {**bad["spec"], "replica": 3}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, VERSIONS[0], strict=True)
    svc = find("Service", "cachehit-router")
    svc = {**svc, "spec": {**svc["spec"], "ports": [{"port": "eighty"}]}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(svc, VERSIONS[0], strict=True)


def router_toml() -> dict[str, Any]:
    return tomllib.loads(find("ConfigMap", "cachehit-router")["data"]["router.toml"])


def test_the_configmap_is_a_valid_router_configuration_with_the_secret_in_the_environment() -> None:
    deploy = find("Deployment", "cachehit-router")
    secret = find("Secret", "cachehit-router")["stringData"]
    (container,) = deploy["spec"]["template"]["spec"]["containers"]
    env = {}
    for e in container["env"]:
        if "valueFrom" in e:
            ref = e["valueFrom"]["secretKeyRef"]
            assert ref["name"] == "cachehit-router"
            assert ref["key"] in secret
            env[e["name"]] = secret[ref["key"]]
        else:
            env[e["name"]] = e["value"]
    cfg = parse_config(layer(router_toml(), env))
    assert cfg.server.api_keys == ("sk-change-me",)
    assert cfg.server.admin_api_key
    assert cfg.server.host == "0.0.0.0"
    # The file the ConfigMap mounts is the one the router reads.
    mount = next(m for m in container["volumeMounts"] if m["name"] == "config")
    assert container["args"] == ["--config", f"{mount['mountPath']}/router.toml"]
    # Kubernetes stops the pod after the grace period: it must cover the drain.
    assert deploy["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > cfg.server.drain_timeout_s + 5


def test_router_replicas_probes_service_and_budget_line_up() -> None:
    deploy = find("Deployment", "cachehit-router")
    labels = deploy["spec"]["template"]["metadata"]["labels"]
    assert deploy["spec"]["replicas"] >= 2
    (container,) = deploy["spec"]["template"]["spec"]["containers"]
    port = router_toml()["server"]["port"]
    assert [p["containerPort"] for p in container["ports"] if p["name"] == "http"] == [port]
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    svc = find("Service", "cachehit-router")
    assert svc["spec"]["selector"].items() <= labels.items()
    assert svc["spec"]["ports"][0]["targetPort"] == "http"
    pdb = find("PodDisruptionBudget", "cachehit-router")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert 0 < pdb["spec"]["minAvailable"] < deploy["spec"]["replicas"]  # a node can still drain
    monitor = find("ServiceMonitor", "cachehit-router")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0]["port"] in {p["name"] for p in svc["spec"]["ports"]}
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"


@pytest.mark.parametrize(("role", "kv_role"), [("decode", "kv_consumer"), ("prefill", "kv_producer")])
def test_engines_are_found_through_their_headless_services(role: str, kv_role: str) -> None:
    table = next(d for d in router_toml()["discovery"] if d["role"] == role)
    service_name, namespace, *rest = table["name"].split(".")
    assert namespace == NAMESPACE
    assert rest == ["svc", "cluster", "local"]
    svc = find("Service", service_name)
    assert svc["spec"]["clusterIP"] == "None"  # headless: DNS answers the pods' IPs
    assert not svc["spec"].get("publishNotReadyAddresses")  # only ready pods
    deploy = find("Deployment", service_name)
    assert svc["spec"]["selector"].items() <= deploy["spec"]["template"]["metadata"]["labels"].items()
    (c,) = deploy["spec"]["template"]["spec"]["containers"]
    assert c["image"].startswith("cachehit-vllm:")  # vLLM's image plus the plugin (docs/DOCKER.md)
    assert f"--port={table['port']}" in c["args"]
    assert any(kv_role in a for a in c["args"] if a.startswith("--kv-transfer-config="))
    assert "--scheduler-cls=engine_launcher.vllm_plugin.scheduler.ThresholdAsyncScheduler" in c["args"]
    assert "--enable-prompt-tokens-details" in c["args"]  # the router reads cached_tokens
    served = next(a.split("=", 1)[1] for a in c["args"] if a.startswith("--served-model-name="))
    assert table["models"] == [served]
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
