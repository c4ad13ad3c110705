"""launch/ and `llmdp submit`, offline.

* launch/cluster.yaml passes Ray's own cluster-launcher validator (prepare_config +
  validate_config: ray-schema.json plus the node-type checks), as `ray up` runs it.
* launch/rayjob.yaml has what KubeRay's RayJob CRD requires, with the right types (a
  compact schema of the CRD's essentials); the full CRD when LLMDP_RAYJOB_CRD names a
  copy of ray.io_rayjobs.yaml.
* launch/slurm.sbatch is valid bash and, run with stub srun/scontrol, starts
  `ray symmetric-run` with arguments Ray accepts and `llmdp train` with a recipe that loads.
* `llmdp submit` validates the recipe first, prints the job with --dry-run without
  contacting anything, and submits the same job through the Ray Jobs SDK.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import shutil
import socket
import stat
import subprocess
from pathlib import Path

import pytest
import yaml

from llmdp.cli import build_parser, main
from llmdp.config.schema import load_recipe
from llmdp.run import submit as submit_mod

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = ROOT / "launch"
IMAGE_ROOT = "/home/ray/llmdp"  # where launch/Dockerfile puts the checkout


def load_at_root(recipe: str, overrides=()):
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        return load_recipe(recipe, list(overrides))
    finally:
        os.chdir(cwd)


# ------------------------------------------------------------------- cluster launcher


def _validate_cluster(raw: dict) -> dict:
    from ray.autoscaler._private.util import prepare_config, validate_config

    cfg = prepare_config(copy.deepcopy(raw))  # fills defaults, merges setup commands
    validate_config(cfg)                       # ray-schema.json + node-type checks
    return cfg


def test_cluster_yaml_passes_rays_validator():
    raw = yaml.safe_load((LAUNCH / "cluster.yaml").read_text())
    cfg = _validate_cluster(raw)
    types = cfg["available_node_types"]
    head = types[cfg["head_node_type"]]
    assert not head["resources"].get("GPU")
    gpu = [t for t in types.values() if t["resources"].get("GPU")]
    assert gpu and all(t["resources"]["GPU"] == 8 and t["max_workers"] >= 1 for t in gpu)
    assert any("pip install" in c and "llmdp" in c for c in cfg["setup_commands"])
    assert any("ray start --head" in c for c in cfg["head_start_ray_commands"])
    assert any("ray start --address=$RAY_HEAD_IP:6379" in c for c in cfg["worker_start_ray_commands"])
    # Shared storage and caches on it, for every process Ray starts.
    opts = " ".join(cfg["docker"]["run_options"])
    for needle in ("/mnt/shared:/mnt/shared", "LLMDP_CACHE=/mnt/shared/", "HF_HOME=/mnt/shared/"):
        assert needle in opts
    assert any("/mnt/shared" in c for c in cfg["initialization_commands"])
    assert re.fullmatch(r"rayproject/ray:\d+\.\d+\.\d+-py3\d+-gpu", cfg["docker"]["image"])
    assert {".venv", ".cache", "runs", ".git"} <= set(cfg["rsync_exclude"])


def test_rays_validator_is_not_vacuous():
    import jsonschema

    raw = yaml.safe_load((LAUNCH / "cluster.yaml").read_text())
    typo = copy.deepcopy(raw)
    typo["available_node_types"]["gpu-8xh100"]["resourcez"] = {"GPU": 8}
    with pytest.raises(jsonschema.ValidationError, match="resourcez"):
        _validate_cluster(typo)
    wrong_head = copy.deepcopy(raw)
    wrong_head["head_node_type"] = "nope"
    with pytest.raises(ValueError, match="head_node_type"):
        _validate_cluster(wrong_head)


# ---------------------------------------------------------------------------- RayJob

_STR = {"type": "string", "minLength": 1}
_INT = {"type": "integer", "minimum": 0}
_QUANTITY = {"anyOf": [{"type": "integer"}, {"type": "string", "pattern": r"^[0-9.]+[A-Za-z]*$"}]}
_CONTAINER = {
    "type": "object",
    "required": ["name", "image"],
    "properties": {
        "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
        "image": _STR,
        "resources": {
            "type": "object",
            "properties": {
                "limits": {"type": "object", "additionalProperties": _QUANTITY},
                "requests": {"type": "object", "additionalProperties": _QUANTITY},
            },
        },
    },
}
_POD_TEMPLATE = {
    "type": "object",
    "required": ["spec"],
    "properties": {
        "spec": {
            "type": "object",
            "required": ["containers"],
            "properties": {"containers": {"type": "array", "minItems": 1, "items": _CONTAINER}},
        }
    },
}
# The RayJob essentials, from KubeRay's CRD (ray.io_rayjobs.yaml, apiVersion ray.io/v1):
# the fields it requires and the types it declares for the ones llmdp relies on.
RAYJOB_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "ray.io/v1"},
        "kind": {"const": "RayJob"},
        "metadata": {
            "type": "object",
            "required": ["name"],
            "properties": {"name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
                                    "maxLength": 63}},
        },
        "spec": {
            "type": "object",
            "required": ["entrypoint", "rayClusterSpec"],
            "properties": {
                "entrypoint": _STR,
                "runtimeEnvYAML": {"type": "string"},
                "submissionMode": {"enum": ["K8sJobMode", "HTTPMode", "InteractiveMode",
                                            "SidecarMode"]},
                "shutdownAfterJobFinishes": {"type": "boolean"},
                "ttlSecondsAfterFinished": _INT,
                "activeDeadlineSeconds": {"type": "integer", "minimum": 1},
                "backoffLimit": _INT,
                "rayClusterSpec": {
                    "type": "object",
                    "required": ["headGroupSpec"],
                    "properties": {
                        "rayVersion": {"type": "string"},
                        "headGroupSpec": {
                            "type": "object",
                            "required": ["template"],
                            "properties": {
                                "rayStartParams": {"type": "object",
                                                   "additionalProperties": {"type": "string"}},
                                "template": _POD_TEMPLATE,
                            },
                        },
                        "workerGroupSpecs": {
                            "type": "array",
                            "minItems": 1,
                            "items": {
                                "type": "object",
                                "required": ["groupName", "template"],
                                "properties": {
                                    "groupName": _STR,
                                    "replicas": _INT,
                                    "minReplicas": _INT,
                                    "maxReplicas": _INT,
                                    "rayStartParams": {"type": "object",
                                                       "additionalProperties": {"type": "string"}},
                                    "template": _POD_TEMPLATE,
                                },
                            },
                        },
                    },
                },
            },
        },
    },
}


def rayjob_problems(doc: dict) -> list[str]:
    """Schema errors plus what llmdp needs from the job: GPU workers, shared storage,
    the cluster deleted afterwards, an `llmdp train` entrypoint."""
    import jsonschema

    v = jsonschema.Draft7Validator(RAYJOB_SCHEMA)
    problems = [f"{'.'.join(map(str, e.path)) or '<root>'}: {e.message}" for e in v.iter_errors(doc)]
    if problems:
        return problems
    spec = doc["spec"]
    cluster = spec["rayClusterSpec"]
    head_pod = cluster["headGroupSpec"]["template"]["spec"]
    if spec.get("shutdownAfterJobFinishes") is not True:
        problems.append("spec.shutdownAfterJobFinishes: must be true")
    if "ttlSecondsAfterFinished" not in spec:
        problems.append("spec.ttlSecondsAfterFinished: missing")
    for i, g in enumerate(cluster["workerGroupSpecs"]):
        where = f"workerGroupSpecs[{i}]"
        if "replicas" not in g or not (g.get("minReplicas", 0) <= g["replicas"] <= g.get("maxReplicas", 2**31)):
            problems.append(f"{where}: need minReplicas <= replicas <= maxReplicas")
        c = g["template"]["spec"]["containers"][0]
        gpus = c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
        if gpus is None or int(gpus) < 1:
            problems.append(f"{where}: no nvidia.com/gpu limit on its container")
        if c["image"] != head_pod["containers"][0]["image"]:
            problems.append(f"{where}: image differs from the head's")
    for name, pod in [("head", head_pod)] + [(g["groupName"], g["template"]["spec"])
                                             for g in cluster["workerGroupSpecs"]]:
        mounts = {m["mountPath"] for m in pod["containers"][0].get("volumeMounts", [])}
        if "/mnt/shared" not in mounts:
            problems.append(f"{name}: the shared volume is not mounted at /mnt/shared")
    if not spec["entrypoint"].startswith("llmdp train "):
        problems.append("spec.entrypoint: must run `llmdp train RECIPE`")
    return problems


def _rayjob_docs():
    docs = [d for d in yaml.safe_load_all((LAUNCH / "rayjob.yaml").read_text()) if d]
    return {d["kind"]: d for d in docs}


def test_rayjob_has_the_crd_essentials():
    docs = _rayjob_docs()
    job = docs["RayJob"]
    assert rayjob_problems(job) == []
    env = yaml.safe_load(job["spec"]["runtimeEnvYAML"])["env_vars"]
    assert env["LLMDP_CACHE"].startswith("/mnt/shared/") and env["HF_HOME"].startswith("/mnt/shared/")
    # The driver's ray.init sets these for its workers; Ray fails a job whose runtime env
    # sets one of them too ("Failed to merge the Job's runtime env").
    from llmdp.base.localray import WORKER_ENV

    assert not set(env) & set(WORKER_ENV)
    claim = docs["PersistentVolumeClaim"]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    vols = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["volumes"]
    assert {"name": "shared", "persistentVolumeClaim": {"claimName": claim["metadata"]["name"]}} in vols


def test_rayjob_check_is_not_vacuous():
    job = _rayjob_docs()["RayJob"]
    broken = copy.deepcopy(job)
    group = broken["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
    del group["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
    group["groupNam"] = group.pop("groupName")
    del broken["spec"]["entrypoint"]
    problems = " | ".join(rayjob_problems(broken))
    assert "'entrypoint' is a required property" in problems
    assert "'groupName' is a required property" in problems
    gpuless = copy.deepcopy(job)
    del gpuless["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"][
        "containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
    assert any("nvidia.com/gpu" in p for p in rayjob_problems(gpuless))


def test_rayjob_entrypoint_runs_a_real_recipe_that_validates():
    argv = shlex.split(_rayjob_docs()["RayJob"]["spec"]["entrypoint"])
    args = build_parser().parse_args(argv[1:])
    assert args.command == "train" and args.recipe.startswith(f"{IMAGE_ROOT}/recipes/")
    recipe = "recipes/" + args.recipe.rsplit("/recipes/", 1)[1]
    assert (ROOT / recipe).is_file()
    cfg = load_at_root(recipe, args.overrides)
    assert cfg.output.dir == "/mnt/shared/runs" and cfg.data.path.startswith("/mnt/shared/")
    group = _rayjob_docs()["RayJob"]["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
    gpus = int(group["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
    assert cfg.scaling.use_gpu and cfg.scaling.num_workers == gpus * group["replicas"]


def _strict_crd_schema(crd: dict) -> dict:
    """The CRD's openAPIV3Schema for v1, rejecting unknown fields like `kubectl apply`
    (server-side strict field validation) does."""
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    schema = version["schema"]["openAPIV3Schema"]

    def strict(s):
        if isinstance(s, dict):
            if (s.get("type") == "object" and "properties" in s and "additionalProperties" not in s
                    and not s.get("x-kubernetes-preserve-unknown-fields")):
                s["additionalProperties"] = False
            for v in s.values():
                strict(v)
        elif isinstance(s, list):
            for v in s:
                strict(v)

    strict(schema)
    return schema


KUBERAY_CRD = Path(__file__).resolve().parents[1] / "fixtures" / "kuberay" / "ray.io_rayjobs.yaml.gz"


def test_rayjob_validates_against_the_kuberay_crd():
    """Against KubeRay's own RayJob CRD (a vendored copy; LLMDP_RAYJOB_CRD may name another)."""
    import gzip

    import jsonschema

    path = Path(os.environ.get("LLMDP_RAYJOB_CRD") or KUBERAY_CRD)
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    crd = yaml.safe_load(text)
    v = jsonschema.Draft7Validator(_strict_crd_schema(crd))
    errors = [f"{list(e.path)}: {e.message}" for e in v.iter_errors(_rayjob_docs()["RayJob"])]
    assert errors == []


def test_ray_versions_agree_across_launch_files():
    """The RayJob's rayVersion, its image's base (launch/Dockerfile) and the cluster
    launcher's image name one Ray version."""
    from_line = next(line for line in (LAUNCH / "Dockerfile").read_text().splitlines()
                     if line.startswith("FROM "))
    docker_version = re.fullmatch(r"FROM rayproject/ray:(\d+\.\d+\.\d+)-\S+", from_line).group(1)
    cluster_image = yaml.safe_load((LAUNCH / "cluster.yaml").read_text())["docker"]["image"]
    job = _rayjob_docs()["RayJob"]
    assert job["spec"]["rayClusterSpec"]["rayVersion"] == docker_version
    assert cluster_image.startswith(f"rayproject/ray:{docker_version}-")
    assert "pip install" in (LAUNCH / "Dockerfile").read_text()
    ignore = (LAUNCH / "Dockerfile.dockerignore").read_text().split()
    assert {".venv", ".cache", "runs", ".git"} <= set(ignore)


# ----------------------------------------------------------------------------- SLURM


def test_sbatch_is_valid_bash_with_the_key_lines():
    script = LAUNCH / "slurm.sbatch"
    subprocess.run(["bash", "-n", str(script)], check=True)
    if shutil.which("shellcheck"):
        subprocess.run(["shellcheck", str(script)], check=True)
    text = script.read_text()
    for line in ("#SBATCH --nodes=", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8",
                 'scontrol show hostnames "$SLURM_JOB_NODELIST"', "ray symmetric-run",
                 '--min-nodes "$SLURM_JOB_NUM_NODES"', 'llmdp train "$RECIPE"',
                 "export LLMDP_CACHE=", "export HF_HOME="):
        assert line in text, line


def test_symmetric_run_is_in_this_ray():
    from ray.scripts.scripts import cli

    assert "symmetric-run" in cli.commands


def _stub(path: Path, body: str) -> None:
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_sbatch_starts_symmetric_run_and_llmdp_train(tmp_path):
    """Run the script with stub srun/scontrol: the command it launches on every node is
    accepted by symmetric-run's own argument check, and its `llmdp train` part loads."""
    bin_dir, venv = tmp_path / "bin", tmp_path / "venv"
    bin_dir.mkdir()
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "activate").write_text("")
    record = tmp_path / "srun.json"
    _stub(bin_dir / "scontrol", 'printf "gpu-node-1\\ngpu-node-2\\n"\n')
    _stub(bin_dir / "srun",
          'for a in "$@"; do [ "$a" = hostname ] && { echo "10.1.2.3 fe80::1"; exit 0; }; done\n'
          f'python3 -c \'import json,sys; json.dump(sys.argv[1:], open("{record}", "w"))\' "$@"\n')
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_SUBMIT_DIR": str(tmp_path),
           "SLURM_JOB_NODELIST": "gpu-node-[1-2]", "SLURM_JOB_NUM_NODES": "2",
           "SLURM_CPUS_PER_TASK": "64", "LLMDP_SHARED": str(tmp_path / "shared"),
           "LLMDP_VENV": str(venv)}
    for k in ("RECIPE", "LLMDP_CACHE", "HF_HOME"):
        env.pop(k, None)
    subprocess.run(["bash", str(LAUNCH / "slurm.sbatch"), "privacy.target_epsilon=4"],
                   env=env, check=True, capture_output=True, text=True, timeout=30)
    argv = json.loads(record.read_text())
    i = argv.index("ray")
    assert argv[:i] == ["--nodes=2", "--ntasks=2", "--ntasks-per-node=1"]
    sep = argv.index("--")
    ray_part, entry = argv[i + 2:sep], argv[sep + 1:]
    assert argv[i + 1] == "symmetric-run"
    assert ray_part[:4] == ["--address", "10.1.2.3:6379", "--min-nodes", "2"]
    from ray.scripts.symmetric_run import curate_and_validate_ray_start_args

    assert curate_and_validate_ray_start_args(ray_part) == ["--num-cpus=64", "--num-gpus=8"]
    assert entry[:3] == ["llmdp", "train", "recipes/qwen2.5-7b-lora-fsdp.yaml"]
    assert entry[-1] == "privacy.target_epsilon=4"  # sbatch arguments are recipe overrides
    cfg = load_at_root(entry[2], entry[3:])
    assert cfg.output.dir == str(tmp_path / "shared" / "runs") and cfg.privacy.target_epsilon == 4
    assert (tmp_path / "shared" / "llmdp-cache").is_dir()


# ---------------------------------------------------------------------- llmdp submit


@pytest.fixture
def offline(monkeypatch):
    """No socket may connect and no Jobs client may be made."""
    def refuse(*a, **k):
        raise AssertionError("contacted the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(submit_mod, "_job_client", refuse)
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


def dry_run(capsys, *argv):
    rc = main(["submit", *argv, "--dry-run"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return json.loads(out), err


def test_submit_dry_run_prints_the_job_and_contacts_nothing(offline, capsys):
    from ray.runtime_env import RuntimeEnv

    sub, err = dry_run(capsys, "recipes/llama-3.2-1b-lora.yaml", "--address", "http://10.0.0.1:8265",
                       "data.path=/mnt/shared/data/notes.jsonl", "--env",
                       "LLMDP_CACHE=/mnt/shared/llmdp-cache", "output.dir=/mnt/shared/runs")
    assert sub["address"] == "http://10.0.0.1:8265"
    assert sub["entrypoint"] == ("python -u -m llmdp.cli train recipes/llama-3.2-1b-lora.yaml "
                                 "data.path=/mnt/shared/data/notes.jsonl output.dir=/mnt/shared/runs")
    rt = sub["runtime_env"]
    assert rt["working_dir"] == os.path.realpath(ROOT)
    assert {"/.venv/", "/.cache/", "/runs/", "/.git/"} <= set(rt["excludes"])
    assert "py_modules" not in rt  # the working dir holds the llmdp package itself
    pkgs = rt["pip"]["packages"]
    assert any(p.startswith("torch") for p in pkgs) and any(p.startswith("dp-accounting") for p in pkgs)
    assert not any(submit_mod._req_name(p) == "ray" for p in pkgs)
    assert rt["env_vars"] == {"LLMDP_CACHE": "/mnt/shared/llmdp-cache"}
    RuntimeEnv(**rt)  # Ray's own validation of every field
    assert sub["submission_id"].startswith("llmdp-llama-3.2-1b-lora-")
    assert sub["ray_job_submit"].startswith("ray job submit --address http://10.0.0.1:8265 ")
    assert sub["ray_job_submit"].endswith(" -- " + sub["entrypoint"])
    # Absolute paths are not shipped: said on stderr (and in the JSON).
    assert "data.path: /mnt/shared/data/notes.jsonl is outside the working dir" in err
    assert "output.dir: /mnt/shared/runs is an absolute path" in err
    assert "LLMDP_CACHE" not in err  # given with --env


def test_submit_entrypoint_is_the_train_command_it_validated(offline, capsys):
    sub, _ = dry_run(capsys, "recipes/gemma-2-2b-lora.yaml", "train.steps=100", "--debug")
    argv = shlex.split(sub["entrypoint"])
    assert argv[:4] == ["python", "-u", "-m", "llmdp.cli"]
    args = build_parser().parse_args(argv[4:])
    assert (args.command, args.recipe, args.overrides, args.debug) == (
        "train", "recipes/gemma-2-2b-lora.yaml", ["train.steps=100"], True)
    assert load_at_root(args.recipe, args.overrides).train.steps == 100
    assert sub["address"] is None  # a dry run needs no cluster
    assert any("output.dir: runs resolves inside the job's working dir" in w for w in sub["warnings"])


def test_submit_validates_the_recipe_before_anything_else(offline, capsys):
    for extra in (["--dry-run"], ["--address", "http://10.0.0.1:8265"]):
        rc = main(["submit", "recipes/llama-3.2-1b-lora.yaml", "privacy.accountant=pdl", *extra])
        out, err = capsys.readouterr()
        assert rc == 2 and out == ""
        assert err.startswith("llmdp: error: privacy.accountant: 'pdl' is not one of")


def test_submit_refuses_env_vars_llmdp_sets_for_its_workers(offline, capsys):
    """The driver's ray.init sets these; Ray fails a job whose runtime env sets one too."""
    rc = main(["submit", "recipes/llama-3.2-1b-lora.yaml", "--env", "HF_HUB_OFFLINE=0", "--dry-run"])
    assert rc == 2 and "HF_HUB_OFFLINE is set by llmdp for its workers" in capsys.readouterr().err
    rc = main(["submit", "recipes/llama-3.2-1b-lora.yaml", "--env", "NOEQUALS", "--dry-run"])
    assert rc == 2 and "expected KEY=VALUE" in capsys.readouterr().err


def test_submit_without_an_address_says_how_to_give_one(offline, capsys):
    assert main(["submit", "recipes/llama-3.2-1b-lora.yaml"]) == 2
    assert "pass --address http://HEAD:8265" in capsys.readouterr().err


def test_submit_from_another_working_dir(tmp_path, monkeypatch, capsys, offline):
    """Recipes kept outside the llmdp checkout: llmdp ships as a py_module, and paths the
    cluster would not see are named."""
    (tmp_path / "recipes").mkdir()
    (tmp_path / "tok").mkdir()
    recipe = tmp_path / "recipes" / "mine.yaml"
    recipe.write_text("model: {init: tiny, tokenizer: tok}\ndata: {path: data/missing.jsonl}\n"
                      "privacy: {target_epsilon: 3, ledger: .cache/ledger.jsonl}\ntrain: {steps: 10}\n")
    monkeypatch.chdir(tmp_path)
    sub, err = dry_run(capsys, "recipes/mine.yaml")
    import llmdp

    assert sub["runtime_env"]["working_dir"] == os.path.realpath(tmp_path)
    assert sub["runtime_env"]["py_modules"] == [os.path.dirname(os.path.abspath(llmdp.__file__))]
    assert sub["entrypoint"] == "python -u -m llmdp.cli train recipes/mine.yaml"
    assert "env_vars" not in sub["runtime_env"]
    assert "data.path: data/missing.jsonl does not exist here" in err
    assert "privacy.ledger: .cache/ledger.jsonl resolves inside the job's working dir" in err
    assert "--env LLMDP_CACHE=" in err
    # A recipe outside the working dir would not be shipped.
    rc = main(["submit", str(ROOT / "recipes" / "gemma-2-2b-lora.yaml"), "--dry-run"])
    assert rc == 2 and "is outside the working dir" in capsys.readouterr().err


class FakeClient:
    def __init__(self, address, status="SUCCEEDED"):
        self.address, self.status, self.calls = address, status, []

    def submit_job(self, **kw):
        self.calls.append(kw)
        return kw["submission_id"]

    async def tail_job_logs(self, job_id):
        yield f"{job_id} step 1/600\n"

    def get_job_status(self, job_id):
        from ray.job_submission import JobStatus

        return JobStatus(self.status)


@pytest.mark.parametrize("status,rc", [("SUCCEEDED", 0), ("FAILED", 1)])
def test_submit_sends_the_dry_run_job_through_the_jobs_sdk(monkeypatch, capsys, status, rc):
    monkeypatch.chdir(ROOT)
    clients = []
    monkeypatch.setattr(submit_mod, "_job_client",
                        lambda a: clients.append(FakeClient(a, status)) or clients[-1])
    argv = ["submit", "recipes/qwen2.5-7b-lora-fsdp.yaml", "--address", "http://h:8265",
            "--submission-id", "job-1", "output.dir=/mnt/shared/runs"]
    planned, _ = dry_run(capsys, *argv[1:])
    assert main(argv) == rc
    out, err = capsys.readouterr()
    (call,) = clients[0].calls
    assert clients[0].address == "http://h:8265"
    assert call["entrypoint"] == planned["entrypoint"] and call["runtime_env"] == planned["runtime_env"]
    assert call["submission_id"] == "job-1"
    assert "job-1 step 1/600" in out and f"job job-1: {status}" in err
    assert main([*argv, "--no-wait"]) == 0  # returns once submitted
    assert "step 1/600" not in capsys.readouterr().out


def test_other_commands_still_refuse_unknown_arguments(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "recipes/tiny-cpu.yaml", "--address", "x"])
    assert e.value.code == 2 and "unrecognized arguments: --address x" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["privacy", "report", "runs/x", "extra=1"])
