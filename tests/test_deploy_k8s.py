"""deploy/k8s/, checked statically (no cluster needed).

* every manifest parses, with a known apiVersion/kind and a name, and validates against
  the Kubernetes JSON schemas (``kubernetes-validate``, strict, 1.29 and the newest);
* the kustomization lists every manifest, and its generators' files exist and validate;
* Services select Deployments' pods and target their ports, Deployments select their pods;
* every ConfigMap/Secret a pod uses is defined in the kustomization;
* container commands are real ``prefix-router`` subcommands (or Envoy) with real flags,
  ``$(VAR)`` references are defined, and the components' ports and names agree;
* what the deployment exposes: ext_proc and Envoy's admin on 127.0.0.1 only, every pod
  port admitted by NetworkPolicies to exactly the peers it should be, Redis behind ACL
  credentials from a Secret that every component reads as a file;
* probes hit container ports, every long-running container has a liveness probe that
  needs the process to answer (tests/test_deploy_probes.py runs them against hung
  processes), resources, non-root;
* ``kubectl kustomize`` builds it (kubectl is part of this machine's image).
"""

from __future__ import annotations

import functools
import ipaddress
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from control_plane.server import load_fleet_file
from prefix_router.core.config import load_config_file
from prefix_router.envoy.bootstrap import render_bootstrap
from prefix_router.ops.bootstrap_cli import build, parse_host_port
from tests.test_deploy_cli_contract import ROOT, ParsedArgs, parse_cli, parse_envoy

K8S = ROOT / "deploy" / "k8s"
KNOWN_KINDS = {
    "Namespace": "v1",
    "ConfigMap": "v1",
    "Secret": "v1",
    "Service": "v1",
    "Deployment": "apps/v1",
    "NetworkPolicy": "networking.k8s.io/v1",
    "PodDisruptionBudget": "policy/v1",
}
COMPONENTS = ("redis", "control-plane", "envoy")
"""The Deployments; ext_proc is a sidecar in Envoy's pod."""
SCHEMA_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())
"""Native sidecars (an init container with restartPolicy Always) need Kubernetes 1.29."""
MONITORING = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
ADMIN_CLIENTS = {"podSelector": {"matchLabels": {"prefix-router.io/admin-client": "true"}}}


def kustomization() -> dict[str, Any]:
    data = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert isinstance(data, dict)
    return data


@functools.cache
def manifests() -> list[dict[str, Any]]:
    """Every manifest the kustomization lists, parsed once (read-only for the tests)."""
    docs = []
    for name in kustomization()["resources"]:
        for doc in yaml.safe_load_all((K8S / name).read_text()):
            if doc is not None:
                doc["__file__"] = name
                docs.append(doc)
    return docs


def by_kind(kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in manifests() if d["kind"] == kind}


def pod_containers(deployment: dict[str, Any]) -> Iterator[dict[str, Any]]:
    spec = deployment["spec"]["template"]["spec"]
    yield from spec.get("initContainers", [])
    yield from spec["containers"]


def container(deployment_name: str, name: str | None = None) -> dict[str, Any]:
    deployment = by_kind("Deployment")[deployment_name]
    for c in pod_containers(deployment):
        if name is None or c["name"] == name:
            return c
    raise AssertionError(f"{deployment_name} has no container {name}")


def cli(c: dict[str, Any]) -> tuple[str, ParsedArgs]:
    assert "command" not in c, "the image's entrypoint is prefix-router: use args"
    return parse_cli([str(a) for a in c["args"]])


def generated(kind: str) -> dict[str, dict[str, Any]]:
    key = {"ConfigMap": "configMapGenerator", "Secret": "secretGenerator"}[kind]
    return {g["name"]: g for g in kustomization().get(key, [])}


# -- files -------------------------------------------------------------------------------


def test_every_manifest_parses_with_a_known_kind() -> None:
    docs = manifests()
    assert docs
    for doc in docs:
        kind = doc.get("kind")
        assert kind in KNOWN_KINDS, f"{doc['__file__']}: unknown kind {kind}"
        assert doc["apiVersion"] == KNOWN_KINDS[kind], f"{doc['__file__']}: {kind} apiVersion"
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", doc["metadata"]["name"])
    names = [(d["kind"], d["metadata"]["name"]) for d in docs]
    assert len(names) == len(set(names)), "duplicate resources"


def test_kustomization_lists_every_manifest_and_its_files_exist() -> None:
    k = kustomization()
    assert k["apiVersion"] == "kustomize.config.k8s.io/v1beta1" and k["kind"] == "Kustomization"
    listed = set(k["resources"])
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk
    assert {f"{c}.yaml" for c in COMPONENTS} <= listed
    for generator in (*k.get("configMapGenerator", []), *k.get("secretGenerator", [])):
        for entry in generator.get("files", []):
            assert (K8S / entry.split("=")[-1]).is_file(), entry
        for literal in generator.get("literals", []):
            assert isinstance(literal, str) and "=" in literal, f"bad literal {literal!r}"
    assert k["namespace"] == next(iter(by_kind("Namespace")))
    assert {i["name"] for i in k["images"]} == {"prefix-router"}


def test_the_config_files_validate() -> None:
    files = {e.split("=")[-1] for e in generated("ConfigMap")["prefix-router-config"]["files"]}
    assert files == {"config/routing.yaml", "config/fleet.yaml"}
    load_config_file(str(K8S / "config" / "routing.yaml"))
    load_fleet_file(str(K8S / "config" / "fleet.yaml"))


def test_the_secret_placeholders_are_empty_and_documented() -> None:
    secret = by_kind("Secret")["prefix-router-admin"]
    assert secret["stringData"] == {"token": ""}  # the control plane refuses an empty token
    assert "openssl rand" in (K8S / "secret.yaml").read_text()
    # Components refuse an empty URL file; the ACL lets nobody in but PING.
    redis_secret = by_kind("Secret")["prefix-router-redis"]["stringData"]
    assert redis_secret == {"url": "", "users.acl": "user default on nopass -@all +ping\n"}
    assert "redis-secret.sh" in (K8S / "secret.yaml").read_text()


@pytest.mark.parametrize("version", SCHEMA_VERSIONS)
def test_every_manifest_validates_against_the_kubernetes_schemas(version: str) -> None:
    for doc in manifests():
        resource = {k: v for k, v in doc.items() if k != "__file__"}
        try:
            kubernetes_validate.validate(resource, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            raise AssertionError(
                f"{doc['__file__']}: {doc['kind']}/{doc['metadata']['name']} against "
                f"Kubernetes {version}: {exc.message} at {list(exc.path)}"
            ) from None


def test_the_schema_check_rejects_what_kubernetes_would() -> None:
    """The check above can fail: an unknown field and a sidecar before 1.28 are refused."""
    envoy = next(
        d for d in manifests() if d["metadata"]["name"] == "envoy" and d["kind"] == "Deployment"
    )
    resource = {k: v for k, v in envoy.items() if k != "__file__"}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(resource, "1.27.0", strict=True)  # restartPolicy: Always
    broken = yaml.safe_load(yaml.safe_dump(resource))
    broken["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGett"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, SCHEMA_VERSIONS[-1], strict=True)


# -- references --------------------------------------------------------------------------


def pod_labels(deployment: str) -> dict[str, str]:
    labels: dict[str, str] = by_kind("Deployment")[deployment]["spec"]["template"]["metadata"][
        "labels"
    ]
    return labels


def test_deployments_select_their_pods_and_services_select_deployments() -> None:
    deployments = by_kind("Deployment")
    assert set(deployments) == set(COMPONENTS)
    for name, d in deployments.items():
        selector = d["spec"]["selector"]["matchLabels"]
        labels = d["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items(), f"{name}: selector does not match its pods"
    for name, service in by_kind("Service").items():
        selector = service["spec"]["selector"]
        matched = [
            d
            for d in deployments.values()
            if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert len(matched) == 1, f"Service {name} selects {len(matched)} Deployments"
        ports = {
            p["name"]: p["containerPort"]
            for c in pod_containers(matched[0])
            for p in c.get("ports", [])
        }
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            assert target in ports or target in ports.values(), f"{name}: targetPort {target}"


def _referenced(kind: str) -> Iterator[tuple[str, str]]:
    for d in by_kind("Deployment").values():
        spec = d["spec"]["template"]["spec"]
        for volume in spec.get("volumes", []):
            if kind == "ConfigMap" and "configMap" in volume:
                yield d["metadata"]["name"], volume["configMap"]["name"]
            if kind == "Secret" and "secret" in volume:
                yield d["metadata"]["name"], volume["secret"]["secretName"]
        for c in pod_containers(d):
            ref_key = {"ConfigMap": "configMapKeyRef", "Secret": "secretKeyRef"}[kind]
            for env in c.get("env", []):
                ref = env.get("valueFrom", {}).get(ref_key)
                if ref:
                    yield d["metadata"]["name"], ref["name"]
            for source in c.get("envFrom", []):
                ref = source.get({"ConfigMap": "configMapRef", "Secret": "secretRef"}[kind])
                if ref:
                    yield d["metadata"]["name"], ref["name"]


@pytest.mark.parametrize("kind", ["ConfigMap", "Secret"])
def test_every_referenced_configmap_and_secret_exists(kind: str) -> None:
    defined = set(by_kind(kind)) | set(generated(kind))
    refs = list(_referenced(kind))
    assert refs
    for deployment, name in refs:
        assert name in defined, f"{deployment} uses {kind} {name}, not in the kustomization"
    # And every key the pods read is there.
    env = generated("ConfigMap")["prefix-router-env"]
    keys = {literal.split("=")[0] for literal in env["literals"]}
    for d in by_kind("Deployment").values():
        for c in pod_containers(d):
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("configMapKeyRef")
                if ref and ref["name"] == "prefix-router-env":
                    assert ref["key"] in keys
    secrets = by_kind("Secret")
    for d in by_kind("Deployment").values():
        for volume in d["spec"]["template"]["spec"].get("volumes", []):
            if "secret" in volume:
                data = secrets[volume["secret"]["secretName"]]["stringData"]
                for item in volume["secret"].get("items", []):
                    assert item["key"] in data, f"{volume['name']}: no key {item['key']}"


def test_volume_mounts_name_pod_volumes() -> None:
    for name, d in by_kind("Deployment").items():
        volumes = {v["name"] for v in d["spec"]["template"]["spec"].get("volumes", [])}
        for c in pod_containers(d):
            for mount in c.get("volumeMounts", []):
                assert mount["name"] in volumes, f"{name}/{c['name']}: volume {mount['name']}"


# -- commands ----------------------------------------------------------------------------


def test_every_command_is_a_real_subcommand_with_real_flags() -> None:
    for name, d in by_kind("Deployment").items():
        for c in pod_containers(d):
            env = {e["name"] for e in c.get("env", [])}
            for arg in map(str, c.get("args", [])):
                for var in re.findall(r"\$\(([A-Za-z_]\w*)\)", arg):
                    assert var in env, f"{name}/{c['name']}: $({var}) is not in its env"
            if c["image"] != "prefix-router":
                continue
            if c.get("command") == ["envoy"]:
                parse_envoy([str(a) for a in c["args"]])
            else:
                cli(c)


def _port(c: dict[str, Any], ref: int | str) -> int:
    for p in c.get("ports", []):
        if ref in (p["containerPort"], p.get("name")):
            return int(p["containerPort"])
    raise AssertionError(f"{c['name']}: {ref} is not a container port")


def _service_port(service: str, name: str) -> int:
    ports = {p["name"]: p["port"] for p in by_kind("Service")[service]["spec"]["ports"]}
    return int(ports[name])


def _is_loopback(host: str) -> bool:
    return host == "localhost" or ipaddress.ip_address(host).is_loopback


def test_components_agree_on_names_and_ports() -> None:
    _, cp = cli(container("control-plane"))
    _, xp = cli(container("envoy", "ext-proc"))
    command, boot = cli(container("envoy", "bootstrap"))
    assert command == "envoy-bootstrap"
    envoy = parse_envoy([str(a) for a in container("envoy", "envoy")["args"]])
    cp_c, xp_c, envoy_c = (
        container("control-plane"),
        container("envoy", "ext-proc"),
        container("envoy", "envoy"),
    )

    # Envoy -> control plane (xDS) by Service name and port.
    host, port = parse_host_port(boot.one("--xds"))
    assert host == "control-plane" and host in by_kind("Service")
    assert port == _service_port("control-plane", "xds") == int(cp.one("--xds-port"))
    assert _port(cp_c, "xds") == int(cp.one("--xds-port"))
    assert _service_port("control-plane", "admin") == int(cp.one("--admin-port")) == 8081
    assert _port(cp_c, "metrics") == int(cp.one("--metrics-port"))
    assert _service_port("control-plane", "metrics") == int(cp.one("--metrics-port"))
    assert int(cp.one("--xds-port")) == 18000

    # Envoy -> ext_proc over loopback, in the same pod.
    (spec,) = boot.options["--ext-proc"]
    assert parse_host_port(spec) == (xp.one("--host"), int(xp.one("--port")))
    assert _port(xp_c, "ext-proc-metrics") == int(xp.one("--metrics-port"))
    assert xp.one("--metrics-host") == "0.0.0.0"

    # Envoy's data and probe ports, and the bootstrap it renders is the one it runs.
    assert _port(envoy_c, "http") == int(boot.one("--listen-port"))
    assert _port(envoy_c, "probes") == int(boot.one("--probe-port"))
    assert by_kind("Service")["envoy"]["spec"]["ports"][0]["targetPort"] == "http"
    assert boot.one("--listen-address") == boot.one("--probe-address") == "0.0.0.0"
    assert envoy.one("-c") == boot.one("--out")
    assert boot.one("--node-id") == "$(POD_NAME)"
    # Envoy's heap limit sits below its container's memory limit: 503s before an OOM kill.
    memory = envoy_c["resources"]["limits"]["memory"]
    assert memory.endswith(("Gi", "Mi"))
    limit = int(memory[:-2]) * (1024**3 if memory.endswith("Gi") else 1024**2)
    assert 0.7 * limit <= int(boot.one("--max-heap-bytes")) <= 0.9 * limit

    # The shared state: both follow one Redis namespace, from one Secret.
    assert cp.one("--namespace") == xp.one("--namespace") == "$(REDIS_NAMESPACE)"
    assert cp.one("--redis-url-file") == xp.one("--redis-url-file")


def _mounted_from(deployment: str, c: dict[str, Any], path: str) -> dict[str, Any]:
    volumes = {
        v["name"]: v
        for v in by_kind("Deployment")[deployment]["spec"]["template"]["spec"]["volumes"]
    }
    for mount in c.get("volumeMounts", []):
        if path.startswith(mount["mountPath"].rstrip("/") + "/"):
            return dict(volumes[mount["name"]], subpath=path[len(mount["mountPath"]) + 1 :])
    raise AssertionError(f"{path} is not under a volume mount of {c['name']}")


def test_files_the_commands_read_are_mounted() -> None:
    cp_c = container("control-plane")
    _, cp = cli(cp_c)
    token = _mounted_from("control-plane", cp_c, cp.one("--token-file"))
    assert token["secret"]["secretName"] == "prefix-router-admin"
    assert {"key": "token", "path": token["subpath"]} in token["secret"]["items"]
    config_files = {
        e.split("=")[-1].split("/")[-1]
        for e in generated("ConfigMap")["prefix-router-config"]["files"]
    }
    for flag in ("--fleet", "--config"):
        volume = _mounted_from("control-plane", cp_c, cp.one(flag))
        assert volume["configMap"]["name"] == "prefix-router-config"
        assert volume["subpath"] in config_files
    boot_c = container("envoy", "bootstrap")
    _, boot = cli(boot_c)
    assert _mounted_from("envoy", boot_c, boot.one("--config"))["subpath"] in config_files
    out = _mounted_from("envoy", boot_c, boot.one("--out"))
    assert "emptyDir" in out
    assert (
        _mounted_from("envoy", container("envoy", "envoy"), boot.one("--out"))["name"]
        == (out["name"])
    )


# -- what the deployment exposes ---------------------------------------------------------------


def _rendered_bootstrap() -> dict[str, Any]:
    """The bootstrap the init container renders, rendered here from its flags."""
    _, boot = cli(container("envoy", "bootstrap"))
    argv = [str(a) for a in container("envoy", "bootstrap")["args"][1:]]
    argv = [a for a in argv if not a.startswith(("--out=", "--config=", "--node-id="))]
    params, config, fleet, _ = build(argv, {})
    doc = yaml.safe_load(render_bootstrap(params, config, fleet))
    assert isinstance(doc, dict)
    return doc


def test_ext_proc_is_a_sidecar_on_loopback() -> None:
    """ext_proc's gRPC port exists only inside Envoy's pod: no Service, no container port."""
    sidecar = container("envoy", "ext-proc")
    assert sidecar["restartPolicy"] == "Always"  # a native sidecar: up before Envoy, down after
    init = [
        c["name"]
        for c in by_kind("Deployment")["envoy"]["spec"]["template"]["spec"]["initContainers"]
    ]
    assert init == ["bootstrap", "ext-proc"]
    _, xp = cli(sidecar)
    assert _is_loopback(xp.one("--host"))
    assert int(xp.one("--port")) not in {p["containerPort"] for p in sidecar["ports"]}
    assert not any(
        c.get("args", [""])[0] == "ext-proc"
        for name, d in by_kind("Deployment").items()
        if name != "envoy"
        for c in pod_containers(d)
    )
    assert "ext-proc" not in by_kind("Service")
    clusters = {c["name"]: c for c in _rendered_bootstrap()["static_resources"]["clusters"]}
    assert clusters["ext_proc"]["type"] == "STATIC"
    for group in clusters["ext_proc"]["load_assignment"]["endpoints"]:
        for endpoint in group["lb_endpoints"]:
            assert _is_loopback(endpoint["endpoint"]["address"]["socket_address"]["address"])


def test_envoy_admin_is_on_loopback_and_probes_and_stats_use_the_probe_listener() -> None:
    _, boot = cli(container("envoy", "bootstrap"))
    envoy = container("envoy", "envoy")
    admin_port = int(boot.one("--admin-port"))
    assert _is_loopback(boot.one("--admin-address"))
    doc = _rendered_bootstrap()
    assert _is_loopback(doc["admin"]["address"]["socket_address"]["address"])
    assert admin_port not in {
        p["containerPort"]
        for c in pod_containers(by_kind("Deployment")["envoy"])
        for p in c.get("ports", [])
    }
    probe_port = int(boot.one("--probe-port"))
    listeners = {entry["name"]: entry for entry in doc["static_resources"]["listeners"]}
    assert listeners["probes"]["address"]["socket_address"]["port_value"] == probe_port
    for kind in ("readinessProbe", "livenessProbe"):
        assert envoy[kind]["httpGet"]["path"] == "/ready"
        assert _port(envoy, envoy[kind]["httpGet"]["port"]) == probe_port
    annotations = by_kind("Deployment")["envoy"]["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == probe_port
    assert annotations["prometheus.io/path"] == "/stats/prometheus"
    # preStop drains the data plane through the loopback admin (envoy-drain: only the data
    # plane, test_envoy_drain.py) and waits for its requests within the grace period.
    command, args = parse_cli(envoy["lifecycle"]["preStop"]["exec"]["command"][3:])
    assert envoy["lifecycle"]["preStop"]["exec"]["command"][:3] == ["python", "-m", "prefix_router"]
    assert (command, args.one("--admin")) == ("envoy-drain", f"127.0.0.1:{admin_port}")
    grace = by_kind("Deployment")["envoy"]["spec"]["template"]["spec"][
        "terminationGracePeriodSeconds"
    ]
    assert 0 < float(args.one("--timeout")) <= grace - 10
    assert listeners["data_plane"]["traffic_direction"] == "INBOUND"
    assert "traffic_direction" not in listeners["probes"]


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, f"unsupported selector {selector}"
    return bool(selector.get("matchLabels", {}).items() <= labels.items())


def _port_matches(
    rule_ports: list[dict[str, Any]] | None, c: dict[str, Any], port: dict[str, Any]
) -> bool:
    if not rule_ports:
        return True
    return any(
        p.get("protocol", "TCP") == "TCP" and p["port"] in (port["name"], port["containerPort"])
        for p in rule_ports
    )


def admitted(deployment: str, port_name: str) -> list[dict[str, Any]]:
    """The peers NetworkPolicies admit to a named port of a Deployment's pods.

    ``[{}]`` means anyone (a rule without ``from``); ``[]`` means nobody.
    """
    labels = pod_labels(deployment)
    (c, port) = next(
        (c, p)
        for c in pod_containers(by_kind("Deployment")[deployment])
        for p in c.get("ports", [])
        if p["name"] == port_name
    )
    peers: list[dict[str, Any]] = []
    for policy in by_kind("NetworkPolicy").values():
        spec = policy["spec"]
        if not _selects(spec["podSelector"], labels):
            continue
        assert "Ingress" in spec["policyTypes"]
        for rule in spec.get("ingress", []):
            if _port_matches(rule.get("ports"), c, port):
                peers.extend(rule.get("from", [{}]))
    return peers


def _pods_of(*deployments: str) -> list[dict[str, Any]]:
    return [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": d}}} for d in deployments]


def test_network_policies_admit_each_port_to_exactly_its_peers() -> None:
    default = by_kind("NetworkPolicy")["default-deny-ingress"]["spec"]
    assert default == {"podSelector": {}, "policyTypes": ["Ingress"]}
    expected = {
        ("envoy", "http"): [{}],  # clients, from wherever the Ingress or load balancer is
        ("envoy", "probes"): [MONITORING],
        ("envoy", "ext-proc-metrics"): [MONITORING],
        ("control-plane", "xds"): _pods_of("envoy"),
        ("control-plane", "admin"): [ADMIN_CLIENTS],
        ("control-plane", "metrics"): [MONITORING],
        ("redis", "redis"): _pods_of("control-plane", "envoy"),
    }
    every_port = {
        (name, p["name"])
        for name, d in by_kind("Deployment").items()
        for c in pod_containers(d)
        for p in c.get("ports", [])
    }
    assert every_port == set(expected), "a port without an expectation (or one gone)"
    for (deployment, port), peers in expected.items():
        got = admitted(deployment, port)
        assert sorted(map(repr, got)) == sorted(map(repr, peers)), (deployment, port, got)


def test_only_pods_that_read_the_redis_url_reach_redis() -> None:
    readers = set()
    for name, d in by_kind("Deployment").items():
        for volume in d["spec"]["template"]["spec"].get("volumes", []):
            secret = volume.get("secret", {})
            if secret.get("secretName") == "prefix-router-redis" and {
                "key": "url",
                "path": "url",
            } in secret.get("items", []):
                readers.add(name)
    assert readers == {"control-plane", "envoy"}
    assert sorted(map(repr, admitted("redis", "redis"))) == sorted(
        map(repr, _pods_of(*sorted(readers)))
    )


def test_redis_credentials_come_from_the_secret_as_files() -> None:
    """No Redis URL in a flag or an environment variable (ps, /proc, kubectl describe)."""
    for name, d in by_kind("Deployment").items():
        for c in pod_containers(d):
            args = [str(a) for a in c.get("args", [])]
            assert not any(a.startswith("--redis-url=") or a == "--redis-url" for a in args)
            assert "REDIS_URL" not in {e["name"] for e in c.get("env", [])}
            if args and args[0] in ("ext-proc", "control-plane"):
                _, parsed = cli(c)
                volume = _mounted_from(name, c, parsed.one("--redis-url-file"))
                assert volume["secret"]["secretName"] == "prefix-router-redis"
                assert {"key": "url", "path": volume["subpath"]} in volume["secret"]["items"]
    assert "REDIS_URL" not in " ".join(generated("ConfigMap")["prefix-router-env"]["literals"])
    redis = container("redis")
    args = [str(a) for a in redis["args"]]
    acl = _mounted_from("redis", redis, args[args.index("--aclfile") + 1])
    assert acl["secret"]["secretName"] == "prefix-router-redis"
    assert {"key": "users.acl", "path": acl["subpath"]} in acl["secret"]["items"]
    assert "requirepass" not in args


def test_the_admin_api_needs_its_token() -> None:
    _, cp = cli(container("control-plane"))
    assert cp.one("--admin-host") == "0.0.0.0"  # for port-forward and admin clients
    assert cp.one("--token-file")  # the control plane refuses a non-loopback host without


# -- probes, resources, security --------------------------------------------------------------


def _long_running(d: dict[str, Any]) -> Iterator[dict[str, Any]]:
    spec = d["spec"]["template"]["spec"]
    yield from (c for c in spec.get("initContainers", []) if c.get("restartPolicy") == "Always")
    yield from spec["containers"]


def test_every_long_running_container_has_a_liveness_probe_that_needs_an_answer() -> None:
    """A TCP probe passes for a hung process (its kernel accepts); these need the process.

    Exec probes end on their own before the kubelet's timeout, so they fail rather than hang
    wherever the runner does not enforce it. tests/test_deploy_probes.py runs them all
    against stopped processes.
    """
    checked = []
    for name, d in by_kind("Deployment").items():
        for c in _long_running(d):
            probe = c["livenessProbe"]
            assert "tcpSocket" not in probe, f"{name}/{c['name']}: TCP passes for a hung process"
            timeout = probe["timeoutSeconds"]
            if "exec" in probe:
                command = " ".join(probe["exec"]["command"])
                deadlines = [int(s) for s in re.findall(r"timeout[ =](\d+)", command)]
                assert deadlines and max(deadlines) < timeout, f"{name}/{c['name']}: {command}"
            checked.append(c["name"])
    assert sorted(checked) == ["control-plane", "envoy", "ext-proc", "redis"]


def test_probes() -> None:
    cp = container("control-plane")
    _, cp_args = cli(cp)
    assert cp["readinessProbe"]["grpc"]["port"] == int(cp_args.one("--xds-port"))
    assert cp["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    sidecar = container("envoy", "ext-proc")
    # Fail open: a pod whose ext_proc is down still serves (without a key), so the sidecar
    # has no readiness probe; its startup probe holds Envoy back until ext_proc serves.
    assert "readinessProbe" not in sidecar
    assert sidecar["startupProbe"]["exec"] == sidecar["livenessProbe"]["exec"]
    _, xp = cli(sidecar)
    assert f"'127.0.0.1:{xp.one('--port')}'" in sidecar["livenessProbe"]["exec"]["command"][2]
    for d in by_kind("Deployment").values():
        for c in d["spec"]["template"]["spec"]["containers"]:
            for probe in ("readinessProbe", "livenessProbe"):
                assert probe in c, f"{c['name']} has no {probe}"
        for c in _long_running(d):
            for kind in ("readinessProbe", "livenessProbe", "startupProbe"):
                spec = c.get(kind, {})
                assert not spec or "timeoutSeconds" in spec, f"{c['name']} {kind}"
                for probe_kind in ("grpc", "httpGet", "tcpSocket"):
                    if probe_kind in spec:
                        _port(c, spec[probe_kind]["port"])


def test_every_container_has_requests_a_memory_limit_and_no_root() -> None:
    for name, d in by_kind("Deployment").items():
        pod = d["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        for c in pod_containers(d):
            resources = c["resources"]
            assert {"cpu", "memory"} <= set(resources["requests"]), f"{name}/{c['name']}"
            assert "memory" in resources["limits"], f"{name}/{c['name']}"
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert c["securityContext"]["readOnlyRootFilesystem"] is True


def test_the_data_plane_keeps_a_replica_through_drains_and_rollouts() -> None:
    """Envoy's pods: a disruption budget that leaves at least one running, a rollout that
    adds before it removes, and replicas spread over nodes."""
    envoy = by_kind("Deployment")["envoy"]
    replicas = envoy["spec"]["replicas"]
    pods = envoy["spec"]["template"]["metadata"]["labels"]
    budget = by_kind("PodDisruptionBudget")["envoy"]["spec"]
    assert budget["selector"]["matchLabels"].items() <= pods.items()
    assert budget["maxUnavailable"] < replicas
    rolling = envoy["spec"]["strategy"]["rollingUpdate"]
    assert rolling["maxUnavailable"] == 0 and rolling["maxSurge"] >= 1
    (spread,) = envoy["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert spread["topologyKey"] == "kubernetes.io/hostname"
    assert spread["labelSelector"]["matchLabels"].items() <= pods.items()


def test_prometheus_annotations_point_at_metrics_ports() -> None:
    expected = {"control-plane": "metrics", "envoy": "probes"}
    assert set(expected) == {
        n
        for n, d in by_kind("Deployment").items()
        if "annotations" in d["spec"]["template"]["metadata"]
    }
    for name, port_name in expected.items():
        d = by_kind("Deployment")[name]
        annotations = d["spec"]["template"]["metadata"]["annotations"]
        main = d["spec"]["template"]["spec"]["containers"][0]
        assert annotations["prometheus.io/scrape"] == "true"
        assert int(annotations["prometheus.io/port"]) == _port(main, port_name)


# -- kustomize ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("kubectl") is None:
        # kubectl comes with this machine's image (CI runs there); Debian's own
        # kubernetes-client (1.20) is too old for this kustomization's `labels:`.
        pytest.skip("kubectl not installed: kustomize build not checked")
    result = subprocess.run(
        ["kubectl", "kustomize", str(K8S)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    out = tmp_path_factory.mktemp("k8s") / "rendered.yaml"
    out.write_text(result.stdout)
    return out


def test_kustomize_builds_and_rewrites_generated_names(rendered: Path) -> None:
    docs = [d for d in yaml.safe_load_all(rendered.read_text()) if d]
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert all(
        d["metadata"].get("namespace") == "prefix-router" for d in docs if d["kind"] != "Namespace"
    )
    config_maps = {n for k, n in names if k == "ConfigMap"}
    text = rendered.read_text()
    for generated_name in generated("ConfigMap"):
        (hashed,) = [n for n in config_maps if n.startswith(generated_name + "-")]
        assert f"name: {generated_name}\n" not in text  # every reference was rewritten
        assert f"name: {hashed}" in text
    assert {"Deployment"} == {k for k, n in names if n in COMPONENTS} - {
        "Service",
        "NetworkPolicy",
        "PodDisruptionBudget",
    }
    for doc in docs:
        kubernetes_validate.validate(doc, SCHEMA_VERSIONS[-1], strict=True)
