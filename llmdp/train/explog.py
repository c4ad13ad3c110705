"""A local experiment log of the run's metrics (``logging.backend``: tensorboard or mlflow),
written by rank 0 beside ``metrics.jsonl`` in the run directory.

Every record the loop writes to ``metrics.jsonl`` is passed on here, split by what it is:

* ``dp/...``: DP releases, accounted in the ledger (the DP evaluation's noisy loss and
  accuracy, ``{"event": "dp_eval"}``);
* ``internal/...``: everything else with a number: the training loss, the held-out loss,
  throughput, clipped fractions, computed on the private data WITHOUT DP.

The internal ones are for the operator's eyes only (DESIGN, invariant `secrets-stay-secret`, invariant `only-dp-outputs-leave`): the log says so in
its own text (a TensorBoard text entry, an MLflow parameter and tag), and rank 0 prints it
once when the log opens. The log lives in the run directory, which is private (owner-only);
nothing from it is exported. The backends are optional extras imported here only when a
recipe asks for one (`llmdp.config.checks.check_logging` refuses a missing one when the
recipe is loaded, naming the field and `pip install 'llmdp[tensorboard]'`).

No server, no network: TensorBoard's event files go to ``<run>/tensorboard/``; MLflow's
tracking store is a SQLite database, ``<run>/mlruns/mlflow.db`` (read it with
``MlflowClient(tracking_uri="sqlite:///<run>/mlruns/mlflow.db")``, or browse it with
``mlflow ui --backend-store-uri`` and that URI, which needs the full ``mlflow`` package).
Not MLflow's folder store (``file:./mlruns``): MLflow 3 put it in maintenance mode and
refuses to open it unless ``MLFLOW_ALLOW_FILE_STORE`` is set; SQLite is MLflow's own local
default (``sqlite:///mlflow.db``), kept here inside the run directory, with the
experiment's artifact location there too (nothing is written to the working directory). The ``mlflow`` extra is ``mlflow-skinny`` (the client, without the UI
server) with SQLAlchemy and Alembic, which its SQLite store needs. MLflow's usage telemetry
is switched off in the process (``MLFLOW_DISABLE_TELEMETRY``, unless the environment sets it).
"""

from __future__ import annotations

import math
import os
import re
import time

__all__ = ["NO_LOG", "WARNING", "ExperimentLog", "mlflow_key", "open_log", "split",
           "tracking_uri"]

WARNING = ("internal/* metrics are computed on the private data WITHOUT differential privacy: "
           "they are for the operator only and must not be published or shared; only dp/* "
           "are DP releases (accounted in the ledger)")
_SKIP = ("step", "time", "event", "privacy", "data", "internal")


def split(record: dict) -> dict[str, float]:
    """The numeric fields of a metrics record under their log names (module docstring);
    nothing for events that are not measurements (start, end, warnings) or a refusal."""
    event = record.get("event")
    if event is None:
        prefix = "internal/train/"
    elif event == "eval":
        prefix = "internal/eval/"
    elif event == "dp_eval" and "refused" not in record:
        prefix = "dp/eval/"
    else:
        return {}
    out = {}
    for k, v in record.items():
        if k in _SKIP or isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        if math.isfinite(v):
            out[prefix + k] = float(v)
    return out


class ExperimentLog:
    """One backend's writer (``open_log``); ``record`` takes metrics.jsonl's records."""

    def __init__(self, backend: str, directory: str, run_name: str, params: dict):
        self.backend, self.directory = backend, directory
        if backend == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter  # lazy: needs tensorboard

            self._tb = SummaryWriter(log_dir=directory)
            self._tb.add_text("WARNING", WARNING, 0)
            self._tb.add_text("params", "\n\n".join(f"{k}: {v}" for k, v in params.items()), 0)
        else:
            os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # no network
            from mlflow.tracking import MlflowClient  # lazy: needs mlflow

            directory = os.path.abspath(directory)
            os.makedirs(directory, exist_ok=True)
            self._ml = MlflowClient(tracking_uri=tracking_uri(directory))
            exp = self._ml.get_experiment_by_name(run_name)
            exp_id = exp.experiment_id if exp is not None else self._ml.create_experiment(
                run_name, artifact_location="file:" + os.path.join(directory, "artifacts"))
            self._run = self._ml.create_run(exp_id, run_name=run_name,
                                            tags={"llmdp.warning": WARNING})
            self._ml.log_param(self._run.info.run_id, "WARNING", WARNING)
            for k, v in params.items():
                self._ml.log_param(self._run.info.run_id, k, v)

    def record(self, record: dict) -> None:
        values = split(record)
        if not values:
            return
        step = int(record.get("step") or 0)
        if self.backend == "tensorboard":
            for k, v in values.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()
        else:
            from mlflow.entities import Metric  # lazy: needs mlflow

            now = int(time.time() * 1000)  # one transaction per record, not one per metric
            self._ml.log_batch(self._run.info.run_id, metrics=[
                Metric(mlflow_key(k), v, now, step) for k, v in values.items()])

    def close(self) -> None:
        if self.backend == "tensorboard":
            self._tb.close()
        else:
            self._ml.set_terminated(self._run.info.run_id)


def tracking_uri(directory: str) -> str:
    """The MLflow tracking store of a run's ``mlruns`` folder (module docstring)."""
    return "sqlite:///" + os.path.join(os.path.abspath(directory), "mlflow.db")


def mlflow_key(key: str) -> str:
    """``key`` as an MLflow metric name: MLflow takes letters, digits, ``_ - . / `` and
    space only (no colon on Windows); anything else becomes ``_``."""
    return re.sub(r"[^\w./ -]", "_", key)


class _NoLog:
    """No ``logging.backend`` (or not rank 0): records go to metrics.jsonl only."""

    def record(self, record: dict) -> None:
        pass

    def close(self) -> None:
        pass


NO_LOG = _NoLog()


def open_log(cfg, run_dir: str, *, log=print):
    """The run's experiment log (rank 0), or NO_LOG without ``logging.backend``; prints
    the warning once."""
    backend = cfg.logging.backend
    if backend is None:
        return NO_LOG
    directory = os.path.join(run_dir, "tensorboard" if backend == "tensorboard" else "mlruns")
    log(f"logging.backend {backend}: {directory}. WARNING: {WARNING}")
    params = {"dp": cfg.privacy.dp, "unit": cfg.data.unit,
              "target_epsilon": cfg.privacy.target_epsilon,
              "max_grad_norm": cfg.privacy.max_grad_norm,
              "expected_batch_size": cfg.train.expected_batch_size}
    return ExperimentLog(backend, directory, cfg.output.name or "run", params)
