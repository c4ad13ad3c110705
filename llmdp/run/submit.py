"""`llmdp submit RECIPE --address ADDR [key=value ...]`: run a recipe on a Ray cluster.

The recipe is validated here first (``load_recipe``, the same checks and messages as
``llmdp train``), then the job is handed to the Ray Jobs API:

    entrypoint   python -u -m llmdp.cli train RECIPE [key=value ...]
    runtime_env  working_dir  this checkout (code, recipes, tokenizers, small data), zipped
                              and uploaded by Ray; .venv, .cache, runs, .git are excluded
                 pip          llmdp's dependencies, read from pyproject.toml (ray left out)
                 env_vars     every --env KEY=VALUE

Why this shape (Ray 2.60):

* ``pip: ["-e ."]`` does not work in a runtime env: pip runs in the runtime-env agent's
  own directory, not in the job's working dir. Instead the working dir is on the job's
  PYTHONPATH (Ray puts it there for the driver and every worker), so ``import llmdp``
  finds the uploaded code, and ``pip`` installs only the dependencies, into a virtualenv
  built on the cluster's Python (``--system-site-packages``, or a clone of the cluster's
  own virtualenv), so what the image already has (torch, ray) is not installed again.
  Ray caches that virtualenv per dependency list: the next job with the same list reuses it.
* ``ray`` is never in that list: a runtime env must not replace the cluster's Ray.
* The entrypoint is ``python -u -m llmdp.cli`` rather than the ``llmdp`` console script,
  which only exists where llmdp was pip-installed.
* A working dir without the ``llmdp`` package (recipes kept elsewhere) gets the installed
  package shipped as a ``py_modules`` entry instead.

On the cluster the job runs in its own copy of the working dir, so relative paths in the
recipe resolve there, exactly as they did here. Absolute paths are not shipped: they must
exist at the same path on the cluster (shared storage). ``output.dir`` and the llmdp cache
(``LLMDP_CACHE``: unit store, models) must be on storage that every node sees and that
outlives the job, and the dataset ledgers (``privacy.ledger``: a postgresql:// URL) must be
the same database for every job on the data;
docs/LAUNCH.md explains.

``--dry-run`` prints the submission as one JSON object and contacts nothing.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import sys
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import llmdp
from llmdp.base.localray import WORKER_ENV
from llmdp.config.schema import ConfigError, RecipeConfig, load_recipe

__all__ = [
    "EXCLUDES",
    "Submission",
    "SubmitError",
    "build_submission",
    "dependencies",
    "submit",
]

# Never shipped: local environments, caches, run outputs, git history (gitwildmatch
# patterns relative to the working dir, as Ray's `excludes` expects them).
EXCLUDES = (
    "/.venv/",
    "/.cache/",
    "/runs/",
    "/.git/",
    "__pycache__/",
    "*.egg-info/",
    "/.pytest_cache/",
    "/.ruff_cache/",
)
_EXCLUDED_TOP = (".venv", ".cache", "runs", ".git", ".pytest_cache", ".ruff_cache")

# Ray uploads the zipped working dir through the GCS; the package must stay below the
# gRPC message limit (512 MiB by default). Warn well before.
_LARGE_BYTES = 100 * 1024 * 1024


class SubmitError(ValueError):
    """The submission cannot be built (not a recipe problem: those are ConfigErrors)."""


@dataclasses.dataclass(frozen=True)
class Submission:
    entrypoint: str
    runtime_env: dict[str, Any]
    submission_id: str
    address: str | None
    warnings: tuple[str, ...]

    def ray_job_submit_command(self) -> str:
        """The same submission as a ``ray job submit`` command line."""
        parts = ["ray", "job", "submit"]
        if self.address:
            parts += ["--address", self.address]
        parts += ["--submission-id", self.submission_id,
                  "--runtime-env-json", json.dumps(self.runtime_env, sort_keys=True), "--"]
        return " ".join(shlex.quote(p) for p in parts) + " " + self.entrypoint

    def to_json(self) -> dict[str, Any]:
        return {
            "address": self.address,
            "submission_id": self.submission_id,
            "entrypoint": self.entrypoint,
            "runtime_env": self.runtime_env,
            "warnings": list(self.warnings),
            "ray_job_submit": self.ray_job_submit_command(),
        }


# ----------------------------------------------------------------------- dependencies


_REQ_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def _req_name(req: str) -> str:
    m = _REQ_NAME.match(req)
    return re.sub(r"[-_.]+", "-", m.group(1)).lower() if m else ""


def _load_toml(path: str) -> dict[str, Any] | None:
    try:
        import tomllib  # Python >= 3.11
    except ModuleNotFoundError:  # pragma: no cover - Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ModuleNotFoundError:
            return None
    with open(path, "rb") as fh:
        return tomllib.load(fh)


def dependencies(working_dir: str) -> list[str]:
    """llmdp's runtime requirements, without ``ray``.

    From ``working_dir/pyproject.toml`` when it is llmdp's (so a dependency added in this
    checkout ships with it), else from the installed distribution's metadata.
    """
    reqs: list[str] | None = None
    pyproject = os.path.join(working_dir, "pyproject.toml")
    if os.path.isfile(pyproject):
        data = _load_toml(pyproject)
        project = (data or {}).get("project", {})
        if project.get("name") == "llmdp":
            reqs = list(project.get("dependencies", []))
    if reqs is None:
        from importlib.metadata import PackageNotFoundError, requires

        try:
            reqs = [r for r in (requires("llmdp") or []) if "extra ==" not in r]
        except PackageNotFoundError as exc:  # pragma: no cover - llmdp runs, so it is installed
            raise SubmitError("cannot find llmdp's dependencies: no pyproject.toml in the "
                              "working dir and llmdp is not installed") from exc
    return [r for r in reqs if _req_name(r) != "ray"]


# -------------------------------------------------------------------------- paths


@contextmanager
def _cwd(path: str) -> Iterator[None]:
    old = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


def _inside(path: str, root: str) -> bool:
    try:
        return os.path.commonpath([os.path.abspath(path), root]) == root
    except ValueError:  # different drives
        return False


def _excluded(path: str, root: str) -> bool:
    rel = os.path.relpath(path, root).split(os.sep)
    return bool(rel) and rel[0] in _EXCLUDED_TOP


def _size(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(dirpath, f))
            except OSError:
                pass
    return total


def _path_warnings(cfg: RecipeConfig, root: str, env_vars: dict[str, str]) -> list[str]:
    """What the cluster will not see the way this machine does."""
    out: list[str] = []
    shown = os.path.relpath
    inputs = {"data.path": cfg.data.path}
    for key, value in (("model.name_or_path", cfg.model.name_or_path),
                       ("model.tokenizer", cfg.model.tokenizer)):
        if value is not None and os.path.isabs(value):  # a hub id stays relative
            inputs[key] = value
    for key, value in inputs.items():
        if value is None or (key == "model.tokenizer" and value == cfg.model.name_or_path):
            continue
        if not _inside(value, root):
            out.append(
                f"{key}: {value} is outside the working dir {root}, so it is not shipped with "
                f"the job; it must exist at this same path on the cluster (shared storage)")
        elif _excluded(value, root) and not (key == "data.path" and cfg.data.synthetic):
            out.append(
                f"{key}: {shown(value, root)} is in a folder that is never uploaded "
                f"({', '.join(_EXCLUDED_TOP)}); move it, or put it on shared storage and give "
                f"its absolute path")
        elif not os.path.exists(value):
            if not (key == "data.path" and cfg.data.synthetic):
                out.append(
                    f"{key}: {shown(value, root)} does not exist here, so it will not be in the "
                    f"uploaded working dir and the job will stop when it reads it")
        elif _size(value) > _LARGE_BYTES:
            out.append(
                f"{key}: {shown(value, root)} is {_size(value) / 2**20:.0f} MiB and would be "
                f"zipped into the job package (Ray caps a working dir at 512 MiB, and private "
                f"data is better kept on shared storage); give an absolute path on shared "
                f"storage instead")
    for key, value, what in (
        ("output.dir", cfg.output.dir, "run directories (checkpoints, ledger, report, model)"),
        ("privacy.ledger", cfg.privacy.ledger, "the dataset ledger"),
    ):
        if value is None or value.startswith(("postgresql://", "postgres://")):
            continue  # a database server: every node reaches it as it is
        if _inside(value, root):
            out.append(
                f"{key}: {shown(value, root)} resolves inside the job's working dir on the "
                f"cluster: a temporary copy on the head node only, not seen by the other "
                f"nodes and deleted with the job; for {what} use shared storage, e.g. "
                + (f"{key}=/mnt/shared/runs" if key == "output.dir" else
                   f"{key}=postgresql://USER@DBHOST/llmdp"))
        else:
            out.append(
                f"{key}: {value} is an absolute path: it must be shared storage mounted at this "
                f"path on every node of the cluster")
    if "LLMDP_CACHE" not in env_vars:
        out.append(
            "LLMDP_CACHE is not set in --env: unless the cluster's nodes set it (launch/ does), "
            "the unit store goes to .cache/llmdp inside the job's temporary working dir, where "
            "other nodes cannot read the units; pass --env LLMDP_CACHE=/mnt/shared/llmdp-cache")
    if cfg.privacy.ledger is None:
        out.append(
            "privacy.ledger is not set: the dataset ledgers default to $LLMDP_HOME/ledger.sqlite "
            "on the node that runs the job (in a container, deleted with it), so a later job on "
            "the same data may not see this job's privacy spend; pass "
            "privacy.ledger=postgresql://USER@DBHOST/llmdp (a database that outlives the cluster)")
    return out


# ---------------------------------------------------------------------- submission


def _parse_env(items: Sequence[str]) -> dict[str, str]:
    env: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise SubmitError(f"--env {item!r}: expected KEY=VALUE, e.g. "
                              f"--env LLMDP_CACHE=/mnt/shared/llmdp-cache")
        if key in WORKER_ENV:
            # The driver passes these to ray.init itself; Ray refuses a job whose runtime
            # env sets the same variable ("Failed to merge the Job's runtime env").
            raise SubmitError(f"--env {item!r}: {key} is set by llmdp for its workers "
                              f"({key}={WORKER_ENV[key]}); leave it out")
        env[key] = value
    return env


def build_submission(
    recipe: str,
    overrides: Sequence[str] = (),
    *,
    address: str | None = None,
    working_dir: str = ".",
    env: Sequence[str] = (),
    pip: bool = True,
    debug: bool = False,
    submission_id: str | None = None,
) -> Submission:
    """Validate ``recipe`` (+ overrides) as the cluster will read it and build the job.

    Raises ConfigError for a bad recipe (the message ``llmdp train`` gives) and
    SubmitError for a submission that cannot work. Contacts nothing.
    """
    root = os.path.realpath(os.path.abspath(os.path.expanduser(working_dir)))
    if not os.path.isdir(root):
        raise SubmitError(f"--working-dir {working_dir!r}: not a directory ({root})")
    recipe_abs = os.path.realpath(os.path.abspath(os.path.expanduser(recipe)))
    if not os.path.isfile(recipe_abs):
        raise ConfigError(f"recipe file not found: {recipe!r} (looked for {recipe_abs})")
    if not _inside(recipe_abs, root):
        raise SubmitError(
            f"recipe {recipe!r} is outside the working dir {root}, so it would not be shipped "
            f"with the job; copy it into the working dir or pass --working-dir")
    if _excluded(recipe_abs, root):
        raise SubmitError(
            f"recipe {recipe!r} is in a folder that is never uploaded ({', '.join(_EXCLUDED_TOP)})")
    recipe_rel = os.path.relpath(recipe_abs, root)

    overrides = list(overrides)
    # The cluster loads the recipe from its copy of the working dir: resolve relative
    # paths against the working dir here too, so that what is checked is what runs.
    with _cwd(root):
        cfg = load_recipe(recipe_rel, overrides)
    env_vars = _parse_env(env)

    # -u: the driver's output reaches the job log as it is printed.
    argv = ["python", "-u", "-m", "llmdp.cli", "train", recipe_rel, *overrides]
    if debug:
        argv.append("--debug")
    entrypoint = " ".join(shlex.quote(a) for a in argv)

    runtime_env: dict[str, Any] = {"working_dir": root, "excludes": list(EXCLUDES)}
    if not os.path.isfile(os.path.join(root, "llmdp", "__init__.py")):
        runtime_env["py_modules"] = [os.path.dirname(os.path.abspath(llmdp.__file__))]
    if pip:
        runtime_env["pip"] = {"packages": dependencies(root), "pip_check": False}
    if env_vars:
        runtime_env["env_vars"] = env_vars

    if submission_id is None:
        submission_id = f"llmdp-{cfg.output.name}-{uuid.uuid4().hex[:8]}"
    return Submission(
        entrypoint=entrypoint,
        runtime_env=runtime_env,
        submission_id=submission_id,
        address=address,
        warnings=tuple(_path_warnings(cfg, root, env_vars)),
    )


def _job_client(address: str):
    """The Ray Jobs SDK client (imported only for a real submission)."""
    from ray.job_submission import JobSubmissionClient

    return JobSubmissionClient(address)


def submit(sub: Submission, *, wait: bool = True, log=print) -> int:
    """Submit ``sub``; with ``wait``, stream its logs and return 0 iff it succeeded."""
    if not sub.address:
        raise SubmitError("no cluster address: pass --address http://HEAD:8265 (the Ray "
                          "dashboard) or set RAY_ADDRESS; --dry-run needs none")
    try:
        client = _job_client(sub.address)
        job_id = client.submit_job(
            entrypoint=sub.entrypoint,
            runtime_env=sub.runtime_env,
            submission_id=sub.submission_id,
            metadata={"llmdp": "train"},
        )
    except Exception as exc:  # connection refused, authentication token, version mismatch
        raise SubmitError(f"cannot submit to {sub.address}: {type(exc).__name__}: {exc}") from None
    log(f"submitted {job_id} to {sub.address}")
    log(f"  logs:   ray job logs --address {sub.address} --follow {job_id}")
    log(f"  status: ray job status --address {sub.address} {job_id}")
    log(f"  stop:   ray job stop --address {sub.address} {job_id}")
    if not wait:
        return 0
    import asyncio

    async def _tail() -> None:
        async for lines in client.tail_job_logs(job_id):
            print(lines, end="", flush=True)

    try:
        asyncio.run(_tail())
    except KeyboardInterrupt:
        log(f"stopped following; the job keeps running (ray job stop ... {job_id} stops it)")
        return 130
    status = client.get_job_status(job_id)
    status = str(getattr(status, "value", status))
    log(f"job {job_id}: {status}")
    return 0 if status == "SUCCEEDED" else 1


def main(args) -> int:
    """The ``submit`` subcommand (called by :func:`llmdp.cli.main`)."""
    address = args.address or os.environ.get("RAY_ADDRESS") or None
    sub = build_submission(
        args.recipe, args.overrides, address=address, working_dir=args.working_dir,
        env=args.env, pip=not args.no_pip, debug=args.debug, submission_id=args.submission_id,
    )
    for w in sub.warnings:
        print(f"llmdp: warning: {w}", file=sys.stderr)
    if args.dry_run:
        print(json.dumps(sub.to_json(), indent=2))
        return 0
    return submit(sub, wait=not args.no_wait, log=lambda m: print(m, file=sys.stderr))
