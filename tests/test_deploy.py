"""deploy/kubernetes: rendered, schema-validated, and held to what docs/scale-out.md says.

- Rendering: `kubectl kustomize` when kubectl is installed, else render_plain()
  (the kustomizations list plain resources only); both must agree.
- Every object validates against the Kubernetes 1.37 schema, strict (unknown
  fields fail), with kubernetes-validate (ships its schemas: offline).
- The Volumes, Probes and resources tables of docs/scale-out.md match the
  Deployment row for row; addresses agree across TorchServe's config.properties,
  the serving container's environment, the proxy's template and the Services.
- The proxy's nginx template runs in Debian's nginx (when installed) against a
  small backend: keys are checked, the Authorization header goes no further.
- The serving container's entrypoint runs on loopback with the ConfigMap's
  config.properties: a real TorchServe 0.12 and a real controller.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from fractions import Fraction
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import kubernetes_validate
import pytest
import requests
import yaml

from packrat.server import free_ports

REPO = Path(__file__).resolve().parents[1]
KUBE = REPO / "deploy" / "kubernetes"
BASE, AUTOSCALE = KUBE / "base", KUBE / "autoscale"
ENTRYPOINT = REPO / "deploy" / "container" / "packrat-pod.sh"
DOC = REPO / "docs" / "scale-out.md"
K8S_VERSION = "1.37.0"  # the newest schema kubernetes-validate 1.37.0 ships

INFERENCE_KEY = "inf-Key_0123456789abcdef"
MANAGEMENT_KEY = "mgmt-Key_0123456789abcdef"


# -- rendering ---------------------------------------------------------------------


def render_plain(path: Path) -> list[dict]:
    """What kustomize renders for a kustomization of plain `resources:` (files or
    directories holding a kustomization), in listed order. Anything else is refused:
    this stands in for kubectl only where the manifests keep to it."""
    kust = yaml.safe_load((path / "kustomization.yaml").read_text())
    extra = set(kust) - {"apiVersion", "kind", "resources"}
    if extra:
        raise ValueError(f"{path}: render_plain handles plain resources only, not {sorted(extra)}")
    docs: list[dict] = []
    for entry in kust["resources"]:
        target = (path / entry).resolve()
        if target.is_dir():
            docs += render_plain(target)
        else:
            docs += [d for d in yaml.safe_load_all(target.read_text()) if d]
    return docs


def render_kubectl(path: Path) -> list[dict]:
    out = subprocess.run(["kubectl", "kustomize", str(path)], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def render(path: Path) -> list[dict]:
    return render_kubectl(path) if shutil.which("kubectl") else render_plain(path)


def by_kind(docs: list[dict]) -> dict[tuple[str, str], dict]:
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


@pytest.fixture(scope="module")
def base() -> dict[tuple[str, str], dict]:
    return by_kind(render(BASE))


@pytest.fixture(scope="module")
def pod(base) -> dict:
    return base[("Deployment", "packrat-torchserve")]["spec"]["template"]


def container(pod: dict, name: str) -> dict:
    spec = pod["spec"]
    return next(c for c in spec.get("initContainers", []) + spec["containers"] if c["name"] == name)


def env(c: dict) -> dict[str, object]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


def ts_properties(base) -> dict[str, str]:
    text = base[("ConfigMap", "packrat-torchserve-config")]["data"]["config.properties"]
    return dict(
        line.split("=", 1) for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")
    )


def proxy_template(base) -> str:
    return base[("ConfigMap", "packrat-auth-proxy-config")]["data"]["packrat.conf.template"]


def proxy_upstreams(base) -> dict[str, str]:
    """The proxy template's upstreams: name -> "host:port"."""
    return dict(re.findall(r"upstream (\w+) \{\s*server ([\d.]+:\d+);", proxy_template(base)))


def host_port(url: str) -> tuple[str, int]:
    host, port = url.split("://", 1)[-1].rstrip("/").rsplit(":", 1)
    return host, int(port)


# -- schema ------------------------------------------------------------------------


@pytest.mark.parametrize("path", [BASE, AUTOSCALE], ids=["base", "autoscale"])
def test_every_object_validates_against_the_kubernetes_schema(path: Path) -> None:
    docs = render(path)
    assert {d["kind"] for d in docs} >= {"Deployment", "Service", "ConfigMap"}
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']}: {exc.message} at {list(exc.path)}")


def test_validation_catches_a_misspelt_field(pod) -> None:
    # The check above can fail: a typo in a probe's name is an unknown field in strict mode.
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "x"},
                  "spec": {"selector": {"matchLabels": {"a": "b"}}, "template": json.loads(json.dumps(pod))}}
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {"tcpSocket": {"port": 1}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


@pytest.mark.skipif(not shutil.which("kubectl"), reason="kubectl not installed")
@pytest.mark.parametrize("path", [BASE, AUTOSCALE], ids=["base", "autoscale"])
def test_plain_renderer_agrees_with_kubectl(path: Path) -> None:
    assert by_kind(render_plain(path)) == by_kind(render_kubectl(path))


# -- the pod against docs/scale-out.md -----------------------------------------------


def doc_table(heading_row: str) -> list[list[str]]:
    """Rows of the docs/scale-out.md table whose header starts with `heading_row`, cells
    stripped of backticks and notes such as " (init)"."""
    lines = DOC.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(heading_row))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows.append([re.sub(r"`([^`]*)`(\s*\([^)]*\))?", r"\1", c) for c in cells])
    return rows


def quantity(text: str) -> Fraction:
    """A Kubernetes resource quantity ("4", "500m", "8Gi") as an exact number."""
    m = re.fullmatch(r"([0-9.]+)(m|k|M|G|T|Ki|Mi|Gi|Ti)?", str(text))
    assert m, f"not a quantity: {text!r}"
    scale = {None: 1, "m": Fraction(1, 1000), "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
             "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}[m.group(2)]
    return Fraction(m.group(1)) * scale


def test_pod_is_guaranteed_with_integer_cpus_for_serving(pod) -> None:
    # Kubernetes' rule for Guaranteed: every container (init containers too) has CPU and
    # memory limits, and requests equal to them.
    spec = pod["spec"]
    for c in spec["initContainers"] + spec["containers"]:
        res = c["resources"]
        for kind in ("cpu", "memory"):
            limit = res["limits"][kind]
            request = res.get("requests", {}).get(kind, limit)
            assert quantity(request) == quantity(limit), f"{c['name']}: {kind} request {request} != limit {limit}"
    # The static CPU manager gives exclusive cores only to integer CPU counts.
    cpu = quantity(container(pod, "serving")["resources"]["limits"]["cpu"])
    assert cpu.denominator == 1 and cpu >= 1
    # The proxy stays in the shared pool: a fraction of a CPU.
    assert quantity(container(pod, "auth-proxy")["resources"]["limits"]["cpu"]).denominator != 1


def test_resources_table_matches_the_pod(pod) -> None:
    spec = pod["spec"]
    actual = {(c["name"], c["resources"]["limits"]["cpu"], c["resources"]["limits"]["memory"])
              for c in spec["initContainers"] + spec["containers"]}
    documented = {(row[0], row[2], row[3]) for row in doc_table("| container | runs |")}
    assert documented == actual


def test_volumes_table_matches_the_pod(pod) -> None:
    spec = pod["spec"]
    kinds = {}
    for v in spec["volumes"]:
        if "configMap" in v:
            kinds[v["name"]] = "ConfigMap"
        elif "secret" in v:
            kinds[v["name"]] = "Secret"
        elif v.get("emptyDir", {}).get("medium") == "Memory":
            kinds[v["name"]] = "emptyDir (memory)"
        else:
            assert "emptyDir" in v, v
            kinds[v["name"]] = "emptyDir"
    actual = {(m["name"], kinds[m["name"]], c["name"], m["mountPath"])
              for c in spec["initContainers"] + spec["containers"] for m in c.get("volumeMounts", [])}
    documented = {tuple(row[:4]) for row in doc_table("| volume | kind |")}
    assert documented == actual
    assert {v["name"] for v in spec["volumes"]} == {row[0] for row in documented}


def probe_summary(probe: dict) -> str:
    if "exec" in probe:
        urls = [a for a in probe["exec"]["command"] if a.startswith("http")]
        return "exec " + " ".join(urls)
    if "httpGet" in probe:
        return f"GET {probe['httpGet']['path']} :{probe['httpGet']['port']}"
    return f"TCP :{probe['tcpSocket']['port']}"


def resolve_port(pod: dict, c: dict, probe: dict) -> dict:
    """The probe with a named port replaced by the container's port number."""
    probe = json.loads(json.dumps(probe))
    for key in ("httpGet", "tcpSocket"):
        if key in probe and isinstance(probe[key]["port"], str):
            probe[key]["port"] = next(p["containerPort"] for p in c["ports"] if p["name"] == probe[key]["port"])
    return probe


def test_probes_table_matches_the_pod(pod) -> None:
    actual = set()
    for c in pod["spec"]["containers"]:
        for kind in ("startup", "readiness", "liveness"):
            if f"{kind}Probe" in c:
                actual.add((c["name"], kind, probe_summary(resolve_port(pod, c, c[f"{kind}Probe"]))))
    assert {tuple(row) for row in doc_table("| container | probe |")} == actual


def test_torchserve_probes_ping_its_inference_address(base, pod) -> None:
    props = ts_properties(base)
    serving = container(pod, "serving")
    for kind in ("startupProbe", "readinessProbe"):
        command = serving[kind]["exec"]["command"]
        assert command[0] == "curl" and "-f" in "".join(a for a in command if a.startswith("-"))
        assert f"{props['inference_address']}/ping" in command
    # The controller listens on loopback: the kubelet's httpGet would go to the pod's
    # address, so the liveness probe runs inside the container too.
    e = env(serving)
    live = serving["livenessProbe"]["exec"]["command"]
    assert live[0] == "curl" and "-f" in "".join(a for a in live if a.startswith("-"))
    assert f"http://{e['PACKRAT_API_HOST']}:{e['PACKRAT_API_PORT']}/healthz" in live


def test_serving_paths_are_on_the_documented_volumes(base, pod) -> None:
    serving = container(pod, "serving")
    e = env(serving)
    mounts = {m["mountPath"]: m["name"] for m in serving["volumeMounts"]}

    def volume_of(path: str) -> str:
        best = max((m for m in mounts if path == m or path.startswith(m.rstrip("/") + "/")), key=len)
        return mounts[best]

    props = ts_properties(base)
    assert e["PACKRAT_MODEL_STORE"] == props["model_store"]
    assert volume_of(props["model_store"]) == "model-store"
    assert volume_of(e["PACKRAT_SLOT_DIR"]) == "packrat-run"
    # A subdirectory: packrat/slots.py refuses a directory others may write into,
    # and an emptyDir's own root is world-writable.
    assert e["PACKRAT_SLOT_DIR"] not in mounts
    assert volume_of(e["PACKRAT_KEY_FILE"]) == "packrat-run"
    assert volume_of(e["PACKRAT_TS_WORKDIR"]) == "torchserve-workdir"
    assert volume_of(e["PACKRAT_STATE_DIR"]) == "packrat-state"
    assert volume_of(e["TS_CONFIG"]) == "torchserve-config"
    assert volume_of(e["PACKRAT_KEYS_DIR"]) == "packrat-keys"
    assert volume_of(e["HOME"]) == "tmp"  # caches under $HOME: the root filesystem is read-only
    seed = container(pod, "seed-model-store")
    assert {m["name"]: m["mountPath"] for m in seed["volumeMounts"]}["model-store"] == props["model_store"]
    # One uid for TorchServe's workers and the controller (status files must be theirs).
    assert serving["securityContext"]["runAsUser"] == seed["securityContext"]["runAsUser"]


def test_keys_are_files_of_the_secret_never_variables(pod) -> None:
    # A variable is inherited by every process of its container (the JVM, the fork
    # server, every worker) and shows in /proc/<pid>/environ: the keys are files.
    spec = pod["spec"]
    for c in spec["initContainers"] + spec["containers"]:
        assert "envFrom" not in c, c["name"]
        for e in c.get("env", []):
            assert "valueFrom" not in e, (c["name"], e)
            assert not re.search(r"_KEY$|TOKEN|SECRET", e["name"]), (c["name"], e["name"])
    volume = next(v for v in spec["volumes"] if v["name"] == "packrat-keys")
    assert volume["secret"]["secretName"] == "packrat-keys"
    assert volume["secret"]["defaultMode"] & 0o007 == 0  # not world-readable
    # The files are root's with group fsGroup: the serving uid's group reads them.
    serving, proxy = container(pod, "serving"), container(pod, "auth-proxy")
    assert spec["securityContext"]["fsGroup"] == serving["securityContext"]["runAsGroup"]
    assert volume["secret"]["defaultMode"] & 0o040
    mounts = {c["name"]: {m["name"]: m for m in c.get("volumeMounts", [])}
              for c in spec["initContainers"] + spec["containers"]}
    assert {name for name, m in mounts.items() if "packrat-keys" in m} == {"serving", "auth-proxy"}
    for name in ("serving", "auth-proxy"):
        assert mounts[name]["packrat-keys"]["readOnly"] is True
    assert env(serving)["PACKRAT_KEYS_DIR"] == mounts["serving"]["packrat-keys"]["mountPath"]
    # The proxy's start.sh KEYS_DIR CONF_DIR COMMAND...
    command = proxy["command"]
    assert command[:2] == ["/bin/sh", f"{mounts['auth-proxy']['auth-proxy-config']['mountPath']}/start.sh"]
    assert command[2] == mounts["auth-proxy"]["packrat-keys"]["mountPath"]
    assert command[3] == mounts["auth-proxy"]["auth-proxy-conf"]["mountPath"] == "/etc/nginx/conf.d"
    assert command[4:] == ["nginx", "-g", "daemon off;"]


def test_every_container_has_a_read_only_root_filesystem(pod) -> None:
    spec = pod["spec"]
    for c in spec["initContainers"] + spec["containers"]:
        context = c["securityContext"]
        assert context["readOnlyRootFilesystem"] is True, c["name"]
        assert context["allowPrivilegeEscalation"] is False and context["capabilities"]["drop"] == ["ALL"]
    # Where each one writes is a writable emptyDir.
    empty = {v["name"] for v in spec["volumes"] if "emptyDir" in v}
    writes = {"seed-model-store": ["/models"],
              "serving": ["/models", "/tmp", "/var/run/packrat", "/var/lib/torchserve", "/var/lib/packrat"],
              "auth-proxy": ["/tmp", "/etc/nginx/conf.d"]}  # nginx-unprivileged: pid and temp files in /tmp
    for name, paths in writes.items():
        mounts = {m["mountPath"]: m for m in container(pod, name)["volumeMounts"]}
        for path in paths:
            assert mounts[path]["name"] in empty and not mounts[path].get("readOnly"), (name, path)


def test_a_network_policy_admits_only_the_published_ports(base, pod) -> None:
    policies = [d for (kind, _), d in base.items() if kind == "NetworkPolicy"]
    assert len(policies) == 1
    spec = policies[0]["spec"]
    assert spec["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert spec["policyTypes"] == ["Ingress"]
    admitted = {(p["protocol"], p["port"]) for rule in spec["ingress"] for p in rule["ports"]}
    published = {(p.get("protocol", "TCP"), p["name"]) for c in pod["spec"]["containers"] for p in c["ports"]}
    assert admitted == published
    # Every rule names its ports (a rule without ports would admit them all).
    assert all(rule.get("ports") for rule in spec["ingress"])
    # The controller's API port is not among them: it is not published at all.
    serving = container(pod, "serving")
    numbers = {p["containerPort"] for c in pod["spec"]["containers"] for p in c["ports"]}
    assert int(env(serving)["PACKRAT_API_PORT"]) not in numbers


def test_the_controller_listens_on_loopback_behind_the_proxy(base, pod) -> None:
    e = env(container(pod, "serving"))
    assert e["PACKRAT_API_HOST"] == "127.0.0.1"
    assert proxy_upstreams(base)["packrat_controller"] == f"{e['PACKRAT_API_HOST']}:{e['PACKRAT_API_PORT']}"
    # The entrypoint's own default is loopback too.
    assert "API_HOST=${PACKRAT_API_HOST:-127.0.0.1}" in ENTRYPOINT.read_text()


def test_only_metrics_leave_loopback_while_the_token_check_is_off(base, pod) -> None:
    props = ts_properties(base)
    assert props["disable_token_authorization"] == "true"
    for key in ("inference_address", "management_address"):
        assert host_port(props[key])[0] == "127.0.0.1", key
    for key in ("grpc_inference_address", "grpc_management_address"):
        assert props[key] == "127.0.0.1", key
    assert props["enable_model_api"] == "true" and props["cpu_launcher_enable"] == "false"
    assert props["metrics_mode"] == "prometheus" and props["allowed_urls"] == "^$"
    serving = container(pod, "serving")
    e = env(serving)
    assert e["PACKRAT_MANAGEMENT_URL"] == props["management_address"]
    metrics_port = host_port(props["metrics_address"])[1]
    assert host_port(e["PACKRAT_METRICS_URL"]) == ("127.0.0.1", metrics_port)
    # The container exposes only what listens beyond loopback.
    assert {p["containerPort"] for p in serving["ports"]} == {metrics_port}


def test_proxy_forwards_to_torchserve_and_listens_on_its_ports(base, pod) -> None:
    props, template = ts_properties(base), proxy_template(base)
    upstreams = proxy_upstreams(base)
    assert upstreams["packrat_inference"] == "%s:%d" % host_port(props["inference_address"])
    assert upstreams["packrat_management"] == "%s:%d" % host_port(props["management_address"])
    proxy = container(pod, "auth-proxy")
    ports = {p["name"]: p["containerPort"] for p in proxy["ports"]}
    assert sorted(int(p) for p in re.findall(r"listen (\d+);", template)) == sorted(ports.values())
    # start.sh fills in exactly these placeholders (nginx's own $variables stay).
    assert set(re.findall(r"@(\w+)@", template)) == {"INFERENCE_KEY", "MANAGEMENT_KEY"}
    conf_dir = next(m for m in proxy["volumeMounts"] if m["mountPath"] == "/etc/nginx/conf.d")
    assert conf_dir["name"] == "auth-proxy-conf"  # the image's default server would take :8080


def test_services_and_scrape_annotations_match_the_pod(base, pod) -> None:
    labels = pod["metadata"]["labels"]
    named = {p["name"]: p["containerPort"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
    main = base[("Service", "packrat-torchserve")]["spec"]
    ctl = base[("Service", "packrat-controller")]
    for svc in (main, ctl["spec"]):
        assert svc["selector"].items() <= labels.items()
        for p in svc["ports"]:
            assert p["targetPort"] in named
    assert {p["targetPort"] for p in main["ports"]} == {"inference", "management"}
    assert ctl["spec"]["clusterIP"] == "None"
    # The controller's /metrics through the proxy's metrics-only server.
    assert {p["targetPort"] for p in ctl["spec"]["ports"]} == {"packrat-metrics"}
    assert "packrat-metrics" in {p["name"] for p in container(pod, "auth-proxy")["ports"]}
    props = ts_properties(base)
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == host_port(props["metrics_address"])[1] == named["metrics"]
    assert ctl["metadata"]["annotations"]["prometheus.io/port"] == str(named["packrat-metrics"])
    assert annotations["prometheus.io/path"] == ctl["metadata"]["annotations"]["prometheus.io/path"] == "/metrics"
    documented = {row[0]: row[1] for row in doc_table("| Service | ports |")}
    assert set(documented) == {"packrat-torchserve", "packrat-controller"}
    for name, svc in (("packrat-torchserve", main), ("packrat-controller", ctl["spec"])):
        for p in svc["ports"]:
            assert f"{p['name']} {p['port']}" in documented[name]


def test_hpa_scales_the_deployment() -> None:
    docs = by_kind(render(AUTOSCALE))
    hpa = docs[("HorizontalPodAutoscaler", "packrat-torchserve")]["spec"]
    target = hpa["scaleTargetRef"]
    assert (target["kind"], target["name"]) in docs
    assert hpa["metrics"][0]["pods"]["metric"]["name"] == "ts_inference_requests_per_second"
    # Replica steps slower than one controller re-plan (min dwell 60 s, docs/scale-out.md).
    assert hpa["behavior"]["scaleUp"]["stabilizationWindowSeconds"] > 60


def test_entrypoint_is_valid_bash() -> None:
    subprocess.run(["bash", "-n", str(ENTRYPOINT)], check=True)
    assert os.access(ENTRYPOINT, os.X_OK)


# -- the proxy in a real nginx ---------------------------------------------------------


def write_keys(directory: Path, inference: str = INFERENCE_KEY, management: str = MANAGEMENT_KEY) -> Path:
    """Secret packrat-keys as its volume holds it: one file per key, no newline."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "inference").write_text(inference)
    (directory / "management").write_text(management)
    return directory


def run_proxy_start(base, tmp: Path, keys: Path) -> subprocess.CompletedProcess:
    """The ConfigMap's start.sh, as the auth-proxy container runs it (`sh start.sh KEYS_DIR
    CONF_DIR COMMAND...`) with the command `true`: it writes CONF_DIR/packrat.conf."""
    data = base[("ConfigMap", "packrat-auth-proxy-config")]["data"]
    script_dir, conf_dir = tmp / "proxy-config", tmp / "conf.d"
    for d in (script_dir, conf_dir):
        d.mkdir(parents=True, exist_ok=True)
    for name in ("start.sh", "packrat.conf.template"):
        (script_dir / name).write_text(data[name])
    return subprocess.run(["/bin/sh", str(script_dir / "start.sh"), str(keys), str(conf_dir), "true"],
                          capture_output=True, text=True, timeout=30, env={"PATH": os.environ["PATH"]})


def start_nginx(tmp: Path, base, listen: dict[int, int], upstream: dict[str, str]) -> subprocess.Popen:
    """nginx on loopback with the configuration start.sh makes from the ConfigMap's
    template and the key files: ports moved to `listen` (template port -> free port),
    upstream addresses moved by `upstream`."""
    started = run_proxy_start(base, tmp, write_keys(tmp / "keys"))
    assert started.returncode == 0, started.stderr
    conf = (tmp / "conf.d" / "packrat.conf").read_text()
    assert INFERENCE_KEY in conf and MANAGEMENT_KEY in conf and "@" not in conf
    for old, new in listen.items():
        conf = conf.replace(f"listen {old};", f"listen 127.0.0.1:{new};")
    for old, new in upstream.items():
        conf = conf.replace(f"server {old};", f"server {new};")
    (tmp / "packrat.conf").write_text(conf)
    user = "user root;\n" if os.geteuid() == 0 else ""
    temp_paths = "\n".join(f"    {k}_temp_path {tmp}/{k};" for k in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    (tmp / "nginx.conf").write_text(
        f"{user}worker_processes 1;\npid {tmp}/nginx.pid;\nerror_log {tmp}/error.log;\n"
        f"events {{ worker_connections 64; }}\n"
        f"http {{\n    access_log off;\n{temp_paths}\n    include {tmp}/packrat.conf;\n}}\n"
    )
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    subprocess.run([nginx, "-t", "-p", str(tmp), "-c", str(tmp / "nginx.conf")], check=True, capture_output=True)
    proc = subprocess.Popen([nginx, "-p", str(tmp), "-c", str(tmp / "nginx.conf"), "-g", "daemon off;"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    for port in listen.values():
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    proc.kill()
                    raise RuntimeError(f"nginx did not start: {(tmp / 'error.log').read_text()}")
                time.sleep(0.05)
    return proc


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


HAS_NGINX = bool(shutil.which("nginx") or Path("/usr/sbin/nginx").exists())


class _Echo(BaseHTTPRequestHandler):
    """Answers every request with what it received (path, Authorization header)."""

    def do_GET(self) -> None:  # noqa: N802
        body = json.dumps({"path": self.path, "authorization": self.headers.get("Authorization"),
                           "port": self.server.server_address[1]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_POST = do_GET

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.skipif(not HAS_NGINX, reason="nginx not installed (apt-get install nginx; .ci/run installs it)")
def test_proxy_checks_the_secret_keys_in_nginx(base, tmp_path: Path) -> None:
    backends = [ThreadingHTTPServer(("127.0.0.1", 0), _Echo) for _ in range(3)]
    for b in backends:
        threading.Thread(target=b.serve_forever, daemon=True).start()
    inf_backend, mgmt_backend, ctl_backend = (b.server_address[1] for b in backends)
    props = ts_properties(base)
    inf, mgmt, ctl_metrics = free_ports(3)
    proc = start_nginx(
        tmp_path, base, {8080: inf, 8081: mgmt, 8086: ctl_metrics},
        {"%s:%d" % host_port(props["inference_address"]): f"127.0.0.1:{inf_backend}",
         "%s:%d" % host_port(props["management_address"]): f"127.0.0.1:{mgmt_backend}",
         proxy_upstreams(base)["packrat_controller"]: f"127.0.0.1:{ctl_backend}"},
    )
    try:
        def get(port: int, path: str, key: str | None, method: str = "GET") -> requests.Response:
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            return requests.request(method, f"http://127.0.0.1:{port}{path}", headers=headers, timeout=10)

        for port, right, other in ((inf, INFERENCE_KEY, MANAGEMENT_KEY), (mgmt, MANAGEMENT_KEY, INFERENCE_KEY)):
            for key in (None, "wrong-key-0123456789", other, right.swapcase(), right + "x", "x" + right):
                r = get(port, "/models", key)
                assert r.status_code == 401, (port, key, r.text)
                assert r.headers["WWW-Authenticate"] == "Bearer"
            r = get(port, "/models", right)
            assert r.status_code == 200, r.text
            seen = r.json()
            assert seen["path"] == "/models" and seen["authorization"] is None  # the key stops at the proxy
            assert seen["port"] == (inf_backend if port == inf else mgmt_backend)
        r = get(inf, "/ping", None)  # the kubelet's readiness probe carries no key
        assert r.status_code == 200 and r.json()["path"] == "/ping"
        assert get(inf, "/ping/../models", None).status_code == 401  # normalised before matching
        assert get(mgmt, "/ping", None).status_code == 401  # open on inference only

        # The controller's API on the management port, /packrat/X -> /v1/X as the plugin maps
        # it; the key goes on (the controller checks it again), a missing or wrong one stops here.
        for path in ("/packrat/models/m/status?last=1", "/packrat/metrics"):
            for key in (None, INFERENCE_KEY, MANAGEMENT_KEY + "x"):
                assert get(mgmt, path, key, "POST").status_code == 401, (path, key)
        seen = get(mgmt, "/packrat/models/m/status?last=1", MANAGEMENT_KEY, "POST").json()
        assert seen == {"path": "/v1/models/m/status?last=1", "authorization": f"Bearer {MANAGEMENT_KEY}",
                        "port": ctl_backend}
        assert get(mgmt, "/packrat/metrics", MANAGEMENT_KEY).json()["path"] == "/metrics"
        assert get(mgmt, "/packrat/../models", MANAGEMENT_KEY).json()["port"] == mgmt_backend
        assert get(inf, "/packrat/models", INFERENCE_KEY).json()["port"] == inf_backend  # TorchServe's
        # The metrics-only server: GET /metrics without a key (a sent key goes no further), nothing else.
        seen = get(ctl_metrics, "/metrics", MANAGEMENT_KEY).json()
        assert seen == {"path": "/metrics", "authorization": None, "port": ctl_backend}
        for method, path in (("GET", "/v1/models"), ("GET", "/metrics/../v1/swaps"), ("GET", "/ui"),
                             ("POST", "/metrics")):
            assert get(ctl_metrics, path, MANAGEMENT_KEY, method).status_code in (403, 404), (method, path)
    finally:
        stop(proc)
        for b in backends:
            b.shutdown()


@pytest.mark.parametrize(("inference", "management", "why"), [
    (INFERENCE_KEY, "short-0123", "16 or more characters"),
    (INFERENCE_KEY, MANAGEMENT_KEY + "/", "16 or more characters"),  # would end the sed expression
    (INFERENCE_KEY + "$", MANAGEMENT_KEY, "16 or more characters"),  # would change the regex
    (INFERENCE_KEY, INFERENCE_KEY, "must differ"),
])
def test_proxy_start_refuses_unsafe_keys(base, tmp_path: Path, inference: str, management: str, why: str) -> None:
    r = run_proxy_start(base, tmp_path, write_keys(tmp_path / "keys", inference, management))
    assert r.returncode == 1 and why in r.stderr, r.stderr
    assert not (tmp_path / "conf.d" / "packrat.conf").exists()


def test_proxy_start_fills_in_the_key_files(base, tmp_path: Path) -> None:
    # A Secret made with --from-file keeps the file's newline: the first line is the key.
    keys = write_keys(tmp_path / "keys", INFERENCE_KEY + "\n", MANAGEMENT_KEY)
    r = run_proxy_start(base, tmp_path, keys)
    assert r.returncode == 0, r.stderr
    conf = tmp_path / "conf.d" / "packrat.conf"
    assert conf.read_text() == (proxy_template(base).replace("@INFERENCE_KEY@", INFERENCE_KEY)
                                .replace("@MANAGEMENT_KEY@", MANAGEMENT_KEY))
    assert conf.stat().st_mode & 0o077 == 0  # the keys in it: nginx's user only


# -- the serving container's processes on loopback --------------------------------------


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                rest = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(rest[2]) == pgid and rest[0] != "Z":
                return True
    return False


def _run_probe(command: list[str], moves: dict[str, str]) -> subprocess.CompletedProcess:
    args = [moves.get(a, a) for a in command]
    return subprocess.run(args, capture_output=True, text=True, timeout=30)


def _listening_addresses(port: int) -> set[str]:
    """The local addresses of TCP sockets listening on `port` (/proc/net/tcp, tcp6)."""
    found = set()
    for name in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{name}").read_text().splitlines()[1:]:
            fields = line.split()
            address, hex_port = fields[1].split(":")
            if fields[3] == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                raw = bytes.fromhex(address)  # 32-bit words in host order
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)) if sys.byteorder == "little" else raw
                found.add(socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, raw))
    return found


def _environments_of_sessions(sessions: set[int]) -> dict[int, tuple[bytes, bytes]]:
    """pid -> (command line, environment) of every live process in `sessions`."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                rest = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if int(rest[3]) in sessions and rest[0] != "Z":
                    found[int(entry.name)] = ((entry / "cmdline").read_bytes(), (entry / "environ").read_bytes())
            except (OSError, IndexError):
                continue  # gone meanwhile
    return found


@pytest.mark.parametrize("var", ["PACKRAT_INFERENCE_KEY", "PACKRAT_MANAGEMENT_KEY"])
def test_entrypoint_refuses_keys_in_its_environment(tmp_path: Path, var: str) -> None:
    # Before anything starts: TorchServe, the fork server and the workers would inherit it.
    environment = {"PATH": os.environ["PATH"], var: MANAGEMENT_KEY,
                   "PACKRAT_KEYS_DIR": str(write_keys(tmp_path / "secret")), "PACKRAT_RUN_DIR": str(tmp_path / "run")}
    r = subprocess.run(["bash", str(ENTRYPOINT)], env=environment, capture_output=True, text=True, timeout=30)
    assert r.returncode == 1 and f"{var} is set" in r.stderr and "as files" in r.stderr, r.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("inference", "management", "why"), [
    (None, MANAGEMENT_KEY, "cannot read the inference key"),
    (INFERENCE_KEY, "short", "must be 16 or more characters"),
    (INFERENCE_KEY, INFERENCE_KEY, "must differ"),
])
def test_entrypoint_refuses_missing_or_unsafe_key_files(tmp_path: Path, inference: str | None, management: str,
                                                         why: str) -> None:
    keys = write_keys(tmp_path / "secret", inference or "x", management)
    if inference is None:
        (keys / "inference").unlink()
    run = tmp_path / "run"
    environment = {"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "PACKRAT_KEYS_DIR": str(keys),
                   "PACKRAT_RUN_DIR": str(run), "PACKRAT_TS_WORKDIR": str(tmp_path / "ts"),
                   "PACKRAT_STATE_DIR": str(tmp_path / "state")}
    r = subprocess.run(["bash", str(ENTRYPOINT)], env=environment, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and why in r.stderr, r.stderr
    assert not (run / "keys" / "key_file.json").exists()


@pytest.mark.torchserve
@pytest.mark.slow
def test_serving_container_runs_torchserve_and_the_controller(base, pod, tmp_path: Path) -> None:
    from packrat.archive import build_named

    store = tmp_path / "models"
    store.mkdir()
    build_named("noop", store)
    props = ts_properties(base)
    ts_inf, ts_mgmt, ts_met, grpc1, grpc2, api, proxy_inf, proxy_mgmt, proxy_ctl = free_ports(9)
    # The ConfigMap's config.properties with its ports and model store moved (this
    # machine runs other servers); every other line as deployed.
    moved = {
        "inference_address": f"http://127.0.0.1:{ts_inf}",
        "management_address": f"http://127.0.0.1:{ts_mgmt}",
        "metrics_address": f"http://127.0.0.1:{ts_met}",
        "grpc_inference_port": str(grpc1),
        "grpc_management_port": str(grpc2),
        "model_store": str(store),
    }
    assert set(moved) <= set(props)
    lines = []
    for line in base[("ConfigMap", "packrat-torchserve-config")]["data"]["config.properties"].splitlines():
        key = line.split("=", 1)[0]
        lines.append(f"{key}={moved[key]}" if key in moved and "=" in line else line)
    (tmp_path / "config.properties").write_text("\n".join(lines) + "\n")

    serving = container(pod, "serving")
    deployed_env = env(serving)
    run = tmp_path / "run"
    pod_env = {
        # Secret packrat-keys as the pod mounts it: files, no variable holds a key.
        "PACKRAT_KEYS_DIR": str(write_keys(tmp_path / "secret")),
        "PACKRAT_MODELS": "noop",
        "TS_CONFIG": str(tmp_path / "config.properties"),
        "PACKRAT_MODEL_STORE": str(store),
        "PACKRAT_TS_WORKDIR": str(tmp_path / "torchserve"),
        "PACKRAT_STATE_DIR": str(tmp_path / "state"),
        "PACKRAT_RUN_DIR": str(run),
        "PACKRAT_KEY_FILE": str(run / "keys" / "key_file.json"),
        "PACKRAT_SLOT_DIR": str(run / "slots"),
        "PACKRAT_MANAGEMENT_URL": moved["management_address"],
        "PACKRAT_METRICS_URL": moved["metrics_address"],
        "PACKRAT_API_HOST": deployed_env["PACKRAT_API_HOST"],
        "PACKRAT_API_PORT": str(api),
        "HOME": str(tmp_path / "tmp"),
        # Tuning profiles on both cores for minutes; this test is about the wiring.
        "PACKRAT_CONTROLLER_ARGS": "--no-tune --no-adapt",
        "TEMP": str(tmp_path / "tmp"),
        "TMPDIR": str(tmp_path / "tmp"),
        "PACKRAT_STOP_GRACE_S": "30",
    }
    (tmp_path / "tmp").mkdir()
    # Every variable set here is set on the deployed container too, but for these
    # (defaulted there: the run dir is the packrat-run mount, no extra flags).
    assert set(pod_env) - set(deployed_env) == {
        "PACKRAT_RUN_DIR", "PACKRAT_CONTROLLER_ARGS", "PACKRAT_STOP_GRACE_S", "TEMP", "TMPDIR"}
    environment = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", **pod_env}
    # The image's working directory, read-only in the pod: nothing may be written there.
    workdir = tmp_path / "image-workdir"
    workdir.mkdir()
    log = open(tmp_path / "pod.log", "wb")
    pod_proc = subprocess.Popen(["bash", str(ENTRYPOINT)], env=environment, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, cwd=workdir)
    nginx = None
    try:
        # The kubelet's view: the startup probe command until it passes.
        probe = serving["startupProbe"]["exec"]["command"]
        moves = {f"{props['inference_address']}/ping": f"{moved['inference_address']}/ping"}
        deadline = time.monotonic() + 240
        while _run_probe(probe, moves).returncode != 0:
            assert pod_proc.poll() is None, (tmp_path / "pod.log").read_text()[-4000:]
            assert time.monotonic() < deadline, (tmp_path / "pod.log").read_text()[-4000:]
            time.sleep(1)
        assert _run_probe(serving["readinessProbe"]["exec"]["command"], moves).returncode == 0
        # The key file the controller reads: TorchServe's format, the Secret's keys, private.
        key_file = run / "keys" / "key_file.json"
        assert oct(key_file.stat().st_mode & 0o777) == "0o600"
        from packrat.apply.keys import read_keys

        keys = read_keys(key_file)
        assert (keys.inference.key, keys.management.key) == (INFERENCE_KEY, MANAGEMENT_KEY)

        ctl = f"http://127.0.0.1:{api}"
        deadline = time.monotonic() + 120
        while True:
            try:
                r = requests.get(f"{ctl}/v1/models", headers={"Authorization": f"Bearer {MANAGEMENT_KEY}"},
                                 timeout=5)
                break
            except requests.ConnectionError:
                assert pod_proc.poll() is None, (tmp_path / "pod.log").read_text()[-4000:]
                assert time.monotonic() < deadline, (tmp_path / "pod.log").read_text()[-4000:]
                time.sleep(0.5)
        assert r.status_code == 200, r.text
        assert "noop" in json.dumps(r.json())  # the controller attached to this TorchServe
        for key in (None, INFERENCE_KEY):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            assert requests.get(f"{ctl}/v1/models", headers=headers, timeout=5).status_code == 401
        assert requests.get(f"{ctl}/metrics", timeout=5).status_code == 200
        # Closed: the controller listens on loopback only; the liveness probe reaches it there.
        assert _listening_addresses(api) == {"127.0.0.1"}
        live = {"http://%s:%s/healthz" % (deployed_env["PACKRAT_API_HOST"], deployed_env["PACKRAT_API_PORT"]):
                f"{ctl}/healthz"}
        assert _run_probe(serving["livenessProbe"]["exec"]["command"], live).returncode == 0
        # No process of the container holds a key in its environment: the entrypoint, the
        # JVM, the fork server, the workers, the controller (TorchServe has a session of its own).
        ts_pid = int(re.search(r"TorchServe pid (\d+)", (tmp_path / "pod.log").read_text()).group(1))
        processes = _environments_of_sessions({pod_proc.pid, ts_pid})
        assert any(b"java" in cmd for cmd, _ in processes.values()), processes.keys()
        assert any(b"packrat.forkserver" in cmd or b"model_service_worker" in cmd for cmd, _ in processes.values())
        for pid, (cmd, environ) in processes.items():
            for key in (INFERENCE_KEY, MANAGEMENT_KEY):
                assert key.encode() not in environ, (pid, cmd[:200])

        if HAS_NGINX:
            # The auth proxy in front, as in the pod: keys checked, TorchServe and the controller answer.
            nginx = start_nginx(
                tmp_path, base, {8080: proxy_inf, 8081: proxy_mgmt, 8086: proxy_ctl},
                {"%s:%d" % host_port(props["inference_address"]): f"127.0.0.1:{ts_inf}",
                 "%s:%d" % host_port(props["management_address"]): f"127.0.0.1:{ts_mgmt}",
                 proxy_upstreams(base)["packrat_controller"]: f"127.0.0.1:{api}"},
            )
            url = f"http://127.0.0.1:{proxy_inf}/predictions/noop"
            assert requests.post(url, data=b"ping", timeout=30).status_code == 401
            r = requests.post(url, data=b"ping", headers={"Authorization": f"Bearer {INFERENCE_KEY}"}, timeout=60)
            assert r.status_code == 200, r.text
            assert requests.get(f"http://127.0.0.1:{proxy_inf}/ping", timeout=10).json()["status"] == "Healthy"
            r = requests.get(f"http://127.0.0.1:{proxy_mgmt}/models",
                             headers={"Authorization": f"Bearer {MANAGEMENT_KEY}"}, timeout=10)
            assert r.status_code == 200 and [m["modelName"] for m in r.json()["models"]] == ["noop"]
            # The controller's API through the proxy (the pod's authenticated path), its /metrics on :8086.
            mine = requests.get(f"{ctl}/v1/models", headers={"Authorization": f"Bearer {MANAGEMENT_KEY}"},
                                timeout=10)
            r = requests.get(f"http://127.0.0.1:{proxy_mgmt}/packrat/models",
                             headers={"Authorization": f"Bearer {MANAGEMENT_KEY}"}, timeout=10)
            assert (r.status_code, r.json()) == (200, mine.json())
            assert requests.get(f"http://127.0.0.1:{proxy_mgmt}/packrat/models", timeout=10).status_code == 401
            r = requests.get(f"http://127.0.0.1:{proxy_ctl}/metrics", timeout=10)
            assert r.status_code == 200 and "packrat_controller_swap_running" in r.text, r.text[:500]

        health = requests.get(f"{ctl}/healthz", timeout=5)  # no token, as the kubelet asks
        served_paths = requests.get(f"{ctl}/openapi.json", timeout=5).json()["paths"]
    finally:
        if nginx is not None:
            stop(nginx)
        # The kubelet's SIGTERM: the entrypoint stops the controller, then TorchServe's group.
        ts_group = None
        for line in (tmp_path / "pod.log").read_text(errors="replace").splitlines():
            m = re.search(r"TorchServe pid (\d+)", line)
            if m:
                ts_group = int(m.group(1))
        if pod_proc.poll() is None:
            pod_proc.send_signal(signal.SIGTERM)  # to the entrypoint only, as the kubelet does
        try:
            code = pod_proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(pod_proc.pid, signal.SIGKILL)
            raise
        finally:
            log.close()
            if ts_group is not None and _group_alive(ts_group):
                os.killpg(ts_group, signal.SIGKILL)
    assert code == 0, (tmp_path / "pod.log").read_text()[-4000:]
    assert ts_group is not None and not _group_alive(ts_group)
    assert list(workdir.iterdir()) == []
    assert "/healthz" in served_paths
    assert health.status_code == 200, health.text
    assert health.json()["status"] == "ok" and health.json()["torchserve_reachable"] is True
    if not HAS_NGINX:  # said, not silent: the rest of the pod passed, its proxy was not tried
        pytest.skip("the pod passed without its auth proxy in front: nginx not installed "
                    "(apt-get install nginx; .ci/run installs it)")
