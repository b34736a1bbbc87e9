"""deploy/k8s/, checked statically (no cluster needed).

* every manifest parses, with a known apiVersion/kind and a name;
* the kustomization lists every manifest, and its generators' files exist and validate;
* Services select Deployments' pods and target their ports, Deployments select their pods;
* every ConfigMap/Secret a pod uses is defined in the kustomization;
* container commands are real ``prefix-router`` subcommands (or Envoy) with real flags,
  ``$(VAR)`` references are defined, and the components' ports and names agree;
* probes (gRPC for ext_proc and the xDS server, ``/ready`` for Envoy) hit container ports;
  every container has resource requests and a memory limit, and runs as non-root;
* ``kubectl kustomize`` builds it when kubectl is installed, ``kubeconform`` validates the
  output against the Kubernetes schemas when it is installed and given a schema location
  (``KUBECONFORM_SCHEMA_LOCATION``; CI has no network to fetch them).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from control_plane.server import load_fleet_file
from prefix_router.core.config import load_config_file
from prefix_router.ops.bootstrap_cli import parse_host_port
from tests.test_deploy_cli_contract import ROOT, ParsedArgs, parse_cli, parse_envoy

K8S = ROOT / "deploy" / "k8s"
KNOWN_KINDS = {
    "Namespace": "v1",
    "ConfigMap": "v1",
    "Secret": "v1",
    "Service": "v1",
    "Deployment": "apps/v1",
}
COMPONENTS = ("redis", "control-plane", "ext-proc", "envoy")


def kustomization() -> dict[str, Any]:
    data = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert isinstance(data, dict)
    return data


def manifests() -> list[dict[str, Any]]:
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


def test_the_admin_token_placeholder_is_empty_and_documented() -> None:
    secret = by_kind("Secret")["prefix-router-admin"]
    assert secret["stringData"] == {"token": ""}  # the control plane refuses an empty token
    assert "openssl rand" in (K8S / "secret.yaml").read_text()


# -- references --------------------------------------------------------------------------


def test_deployments_select_their_pods_and_services_select_deployments() -> None:
    deployments = by_kind("Deployment")
    assert set(deployments) == set(COMPONENTS)
    for name, d in deployments.items():
        selector = d["spec"]["selector"]["matchLabels"]
        labels = d["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items(), f"{name}: selector does not match its pods"
    for name, service in by_kind("Service").items():
        selector = service["spec"]["selector"]
        matched = [d for d in deployments.values()
                   if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert len(matched) == 1, f"Service {name} selects {len(matched)} Deployments"
        ports = {p["name"]: p["containerPort"] for c in matched[0]["spec"]["template"]["spec"]
                 ["containers"] for p in c.get("ports", [])}
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


def test_components_agree_on_names_and_ports() -> None:
    _, cp = cli(container("control-plane"))
    _, xp = cli(container("ext-proc"))
    command, boot = cli(container("envoy", "bootstrap"))
    assert command == "envoy-bootstrap"
    envoy = parse_envoy([str(a) for a in container("envoy", "envoy")["args"]])
    cp_c, xp_c, envoy_c = container("control-plane"), container("ext-proc"), container(
        "envoy", "envoy"
    )

    # Envoy -> control plane (xDS) by Service name and port.
    host, port = parse_host_port(boot.one("--xds"))
    assert host == "control-plane" and host in by_kind("Service")
    assert port == _service_port("control-plane", "xds") == int(cp.one("--xds-port"))
    assert _port(cp_c, "xds") == int(cp.one("--xds-port"))
    assert _service_port("control-plane", "admin") == int(cp.one("--admin-port")) == 8081
    assert int(cp.one("--xds-port")) == 18000

    # Envoy -> ext_proc through a headless Service (all pods in DNS).
    (spec,) = boot.options["--ext-proc"]
    host, port = parse_host_port(spec)
    assert host == "ext-proc" and by_kind("Service")[host]["spec"]["clusterIP"] == "None"
    assert port == _service_port("ext-proc", "grpc") == int(xp.one("--port"))
    assert _port(xp_c, "grpc") == int(xp.one("--port"))
    assert _port(xp_c, "metrics") == int(xp.one("--metrics-port"))

    # Envoy's data and admin ports, and the bootstrap it renders is the one it runs.
    assert _port(envoy_c, "http") == int(boot.one("--listen-port"))
    assert _port(envoy_c, "admin") == int(boot.one("--admin-port"))
    assert by_kind("Service")["envoy"]["spec"]["ports"][0]["targetPort"] == "http"
    assert boot.one("--listen-address") == boot.one("--admin-address") == "0.0.0.0"
    assert envoy.one("-c") == boot.one("--out")
    assert boot.one("--node-id") == "$(POD_NAME)"

    # The shared state: both follow one Redis namespace; the in-cluster Redis serves it.
    assert cp.one("--redis-url") == xp.one("--redis-url") == "$(REDIS_URL)"
    literals = dict(
        entry.split("=", 1) for entry in generated("ConfigMap")["prefix-router-env"]["literals"]
    )
    assert literals["REDIS_URL"] == f"redis://redis:{_service_port('redis', 'redis')}/0"


def _mounted_from(deployment: str, c: dict[str, Any], path: str) -> dict[str, Any]:
    volumes = {v["name"]: v for v in by_kind("Deployment")[deployment]["spec"]["template"]
               ["spec"]["volumes"]}
    for mount in c.get("volumeMounts", []):
        if path.startswith(mount["mountPath"].rstrip("/") + "/"):
            return dict(volumes[mount["name"]], subpath=path[len(mount["mountPath"]) + 1:])
    raise AssertionError(f"{path} is not under a volume mount of {c['name']}")


def test_files_the_commands_read_are_mounted() -> None:
    cp_c = container("control-plane")
    _, cp = cli(cp_c)
    token = _mounted_from("control-plane", cp_c, cp.one("--token-file"))
    assert token["secret"]["secretName"] == "prefix-router-admin"
    assert {"key": "token", "path": token["subpath"]} in token["secret"]["items"]
    config_files = {e.split("=")[-1].split("/")[-1]
                    for e in generated("ConfigMap")["prefix-router-config"]["files"]}
    for flag in ("--fleet", "--config"):
        volume = _mounted_from("control-plane", cp_c, cp.one(flag))
        assert volume["configMap"]["name"] == "prefix-router-config"
        assert volume["subpath"] in config_files
    boot_c = container("envoy", "bootstrap")
    _, boot = cli(boot_c)
    assert _mounted_from("envoy", boot_c, boot.one("--config"))["subpath"] in config_files
    out = _mounted_from("envoy", boot_c, boot.one("--out"))
    assert "emptyDir" in out
    assert _mounted_from("envoy", container("envoy", "envoy"), boot.one("--out"))["name"] == (
        out["name"]
    )


# -- probes, resources, security --------------------------------------------------------------


def test_probes() -> None:
    for name in ("control-plane", "ext-proc"):
        c = container(name)
        grpc_port = int(cli(c)[1].one("--xds-port" if name == "control-plane" else "--port"))
        for probe in ("readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"]["port"] == grpc_port, f"{name} {probe}"
            assert _port(c, c[probe]["grpc"]["port"])
    envoy = container("envoy", "envoy")
    assert envoy["readinessProbe"]["httpGet"]["path"] == "/ready"
    for d in by_kind("Deployment").values():
        for c in d["spec"]["template"]["spec"]["containers"]:
            for probe in ("readinessProbe", "livenessProbe"):
                assert probe in c, f"{c['name']} has no {probe}"
                spec = c[probe]
                for kind in ("grpc", "httpGet", "tcpSocket"):
                    if kind in spec:
                        _port(c, spec[kind]["port"])


def test_every_container_has_requests_a_memory_limit_and_no_root() -> None:
    for name, d in by_kind("Deployment").items():
        pod = d["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        for c in pod_containers(d):
            resources = c["resources"]
            assert {"cpu", "memory"} <= set(resources["requests"]), f"{name}/{c['name']}"
            assert "memory" in resources["limits"], f"{name}/{c['name']}"
            assert c["securityContext"]["allowPrivilegeEscalation"] is False


# -- tools, when installed ----------------------------------------------------------------


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl not installed")
    result = subprocess.run(["kubectl", "kustomize", str(K8S)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    out = tmp_path_factory.mktemp("k8s") / "rendered.yaml"
    out.write_text(result.stdout)
    return out


def test_kustomize_builds_and_rewrites_generated_names(rendered: Path) -> None:
    docs = [d for d in yaml.safe_load_all(rendered.read_text()) if d]
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert all(d["metadata"].get("namespace") == "prefix-router" for d in docs
               if d["kind"] != "Namespace")
    config_maps = {n for k, n in names if k == "ConfigMap"}
    text = rendered.read_text()
    for generated_name in generated("ConfigMap"):
        (hashed,) = [n for n in config_maps if n.startswith(generated_name + "-")]
        assert f"name: {generated_name}\n" not in text  # every reference was rewritten
        assert f"name: {hashed}" in text
    assert {"Deployment"} == {k for k, n in names if n in COMPONENTS} - {"Service"}


def test_kubeconform_accepts_the_manifests(rendered: Path) -> None:
    """Needs kubeconform and, offline, a local copy of the schemas (its default is a URL)."""
    binary = shutil.which("kubeconform")
    schemas = os.environ.get("KUBECONFORM_SCHEMA_LOCATION")
    if binary is None or not schemas:
        pytest.skip("kubeconform or KUBECONFORM_SCHEMA_LOCATION not available")
    result = subprocess.run(
        [binary, "-strict", "-summary", "-schema-location", schemas, str(rendered)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_prometheus_annotations_point_at_metrics_ports() -> None:
    expected = {"control-plane": "admin", "ext-proc": "metrics", "envoy": "admin"}
    for name, port_name in expected.items():
        d = by_kind("Deployment")[name]
        annotations = d["spec"]["template"]["metadata"]["annotations"]
        main = d["spec"]["template"]["spec"]["containers"][0]
        assert annotations["prometheus.io/scrape"] == "true"
        assert int(annotations["prometheus.io/port"]) == _port(main, port_name)
