"""Before a launch: the checkpoint Ray Train restores is the newest *intact* one.

How Ray Train (v2) restores: a run started again with the same ``RunConfig(name,
storage_path)`` (``checkpoints`` in the run directory) has its controller's
``CheckpointManager`` read ``checkpoints/checkpoint_manager_snapshot.json``: the checkpoints
it registered (in report order) and the latest of them. It checks that each listed folder
exists (else ``CheckpointManagerInitializationError``, whose advice is to delete the folder:
all progress) and hands every worker the latest one; it never reads a checkpoint itself. A
folder it lists may still be damaged: its copy into storage is not atomic, and a full or
failing disk truncates or flips what it holds.

Why the driver repairs Ray's record, before the launch, rather than the worker choosing
another checkpoint at restore: the worker is handed one checkpoint, and Ray's own state
(what it restores after a worker failure, which folders its ``num_to_keep`` deletes, what
``RunDir`` reports as the resume point, what the export checks the model against) would keep
naming the damaged one. Here, under the run lock, nothing else writes the storage: every
candidate is read against its manifest (`llmdp.record.checkpoints.verify`), newest first; a
damaged one is moved to ``checkpoints/damaged/`` (kept, never deleted), a listed folder that
is gone is left out, and the snapshot is rewritten (atomically) to list what is left with
the newest intact checkpoint as the latest. Ray then restores exactly that one, and so does
everything else that reads the run directory. The worker is told which folder was read
(``RunSpec.verified_checkpoint``) and reads again only one registered during the launch.

The ledger: the steps after the checkpoint resumed from ran, and their releases stay in the
ledger; they run again and are charged again (an over-count, never an under-count). With
``privacy.target_epsilon`` that can stop the run before its last step, and the stop says so
(``privacy.allow_exceed_target_on_failure`` finishes it anyway, ε above the target).
"""

from __future__ import annotations

import json
import os

from llmdp._fs import atomic_write
from llmdp.record import checkpoints
from llmdp.record.checkpoints import CheckpointError
from llmdp.record.rundir import RAY_TRAIN_SNAPSHOT

__all__ = ["DAMAGED", "restore_point"]

DAMAGED = "damaged"  # checkpoints/damaged/: damaged checkpoints, set aside (never deleted)


def _read_snapshot(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            snap = json.load(f)
    except (OSError, ValueError):
        return None
    ok = isinstance(snap, dict) and isinstance(snap.get("checkpoint_results"), list) and all(
        isinstance(r, dict) and isinstance(r.get("checkpoint_dir_name"), str)
        for r in snap["checkpoint_results"])
    return snap if ok else None


def _on_disk(storage: str) -> list[str]:
    """Checkpoint folders in ``storage``, oldest first (Ray names them by time)."""
    return sorted(n for n in os.listdir(storage) if n.startswith("checkpoint_")
                  and os.path.isdir(os.path.join(storage, n)))


def _set_aside(storage: str, name: str) -> str:
    dest_dir = os.path.join(storage, DAMAGED)
    os.makedirs(dest_dir, exist_ok=True)
    dest, n = os.path.join(dest_dir, name), 1
    while os.path.exists(dest):
        n += 1
        dest = os.path.join(dest_dir, f"{name}.{n}")
    os.replace(os.path.join(storage, name), dest)
    return dest


def _result(storage: str, name: str, old: dict | None) -> dict:
    if old is not None:
        return old
    try:
        step = int(checkpoints.read_meta(os.path.join(storage, name))["step"])
    except Exception:  # noqa: BLE001 - an older, unread checkpoint: Ray needs no step
        step = None
    return {"version": 0, "checkpoint_dir_name": name, "metrics": {"step": step}}


def _write_snapshot(storage: str, snapshot: dict | None, keep: list[str], latest: str | None) -> None:
    """Ray Train's snapshot listing ``keep`` (oldest first), ``latest`` the latest: the old
    one edited (its report indices, validation states kept), or a new one in its schema."""
    import ray  # lazy: only a run directory that needs repair pays for it

    old = {r["checkpoint_dir_name"]: (r, i) for r, i in zip(
        (snapshot or {}).get("checkpoint_results") or [],
        (snapshot or {}).get("checkpoint_report_indices") or range(10**9))}
    results = [_result(storage, n, old.get(n, (None, None))[0]) for n in keep]
    indices = [old[n][1] if n in old else i for i, n in enumerate(keep)]
    snap = dict(snapshot or {})
    pending = [(r, v) for r, v in zip(snap.get("pending_training_results") or [],
                                      snap.get("pending_validation_specs") or [])
               if r.get("checkpoint_dir_name") in keep]
    snap.update({
        "ray_version": snap.get("ray_version", ray.__version__),
        "checkpoint_results": results,
        "checkpoint_report_indices": indices,
        "latest_checkpoint_result": next((r for r in results if r["checkpoint_dir_name"] == latest), None),
        "pending_training_results": [r for r, _ in pending],
        "pending_validation_specs": [v for _, v in pending],
        "current_report_index": max([int(snap.get("current_report_index") or 0)]
                                    + [int(i) + 1 for i in indices]),
    })
    for key in ("validated_checkpoint_dir_names", "timed_out_validation_checkpoint_dir_names",
                "failed_validation_checkpoint_dir_names"):
        snap[key] = [n for n in snap.get(key) or [] if n in keep]
    path = os.path.join(storage, RAY_TRAIN_SNAPSHOT)
    data = json.dumps(snap).encode()
    atomic_write(path, lambda f: f.write(data))


def restore_point(run_dir: str, log=print) -> str | None:
    """The name of the checkpoint folder a launch in ``run_dir`` resumes from, read whole
    against its manifest (None: nothing to resume from), with Ray Train's record repaired to
    name it (module docstring). A run whose every checkpoint is damaged raises one
    `CheckpointError` (they are set aside first, so the same command then trains from step
    0, and says what that costs)."""
    storage = os.path.join(os.path.abspath(run_dir), "checkpoints")
    if not os.path.isdir(storage):
        return None
    snapshot = _read_snapshot(os.path.join(storage, RAY_TRAIN_SNAPSHOT))
    snapshot_there = os.path.exists(os.path.join(storage, RAY_TRAIN_SNAPSHOT))
    if snapshot is not None:
        listed = [r["checkpoint_dir_name"] for r in snapshot["checkpoint_results"]]
        latest = (snapshot.get("latest_checkpoint_result") or {}).get("checkpoint_dir_name")
        candidates = listed + ([latest] if latest and latest not in listed else [])
    else:  # none (a run that registered nothing yet), or unreadable: what is on disk
        candidates, latest = _on_disk(storage), None
    present = [n for n in candidates if os.path.isdir(os.path.join(storage, n))]
    missing = [n for n in candidates if n not in present]
    # Written before checkpoints had manifests: none of them has one; read their meta only.
    legacy = bool(present) and not any(checkpoints.has_manifest(os.path.join(storage, n)) for n in present)
    chosen, damaged = None, {}
    for name in reversed(present):
        folder = os.path.join(storage, name)
        problem = _legacy_problem(folder) if legacy else checkpoints.verify(folder)
        if problem is None:
            chosen = name
            break
        damaged[name] = problem
    if legacy and chosen is not None:
        log(f"note: the checkpoints in {storage} were written by an earlier llmdp without "
            f"checksums; resuming from {chosen} (its state reads)")
    if not damaged and not missing and snapshot is not None and chosen == latest:
        return chosen  # Ray's record already names the newest intact checkpoint
    if snapshot is None and not present and not snapshot_there:
        return None  # nothing was ever registered
    for name, problem in damaged.items():
        where = _set_aside(storage, name)
        log(f"checkpoint {name} is damaged ({problem}): set aside in {where} (kept)")
    for name in missing:
        log(f"checkpoint {name} is listed by Ray Train's record but gone: left out of it")
    keep = [n for n in present if n not in damaged]
    _write_snapshot(storage, snapshot, keep, chosen)
    if chosen is None:
        if not damaged:
            return None  # only folders that are gone: nothing to resume from, nothing lost now
        raise CheckpointError(
            f"no intact checkpoint to resume from in {storage}: "
            + "; ".join(f"{n}: {p}" for n, p in damaged.items())
            + f". The damaged ones were moved to {os.path.join(storage, DAMAGED)} (kept, not "
            f"deleted). Re-run the same command to train again from step 0: the steps this "
            f"run's ledger records stay charged, so ε counts them as well (an over-count, never "
            f"an under-count), and with privacy.target_epsilon the run may stop before its last "
            f"step (privacy.allow_exceed_target_on_failure: true finishes it, ε above the target)")
    if damaged or chosen != latest:
        step = checkpoints.read_meta(os.path.join(storage, chosen)).get("step")
        log(f"resuming from the newest intact checkpoint, {chosen} (step {step}); the steps "
            f"after it stay charged in the ledger and run again")
    return chosen


def _legacy_problem(folder: str) -> str | None:
    try:
        checkpoints.read_meta(folder)
    except Exception as e:  # noqa: BLE001 - any failure to read it is damage
        return f"its state cannot be read ({type(e).__name__}: {str(e)[:200]})"
    return None
