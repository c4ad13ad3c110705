"""Training checkpoints on disk: the two formats, and the one reader of both (the worker's
resume, ``RunDir``'s resume point, ``llmdp export``'s check of the final weights).

A checkpoint is one folder (Ray Train's ``checkpoints/checkpoint_*``, or a ``LocalContext``'s):

full (``scaling.strategy: replicated``; ``fsdp`` checkpoints from before the sharded format)
    ``state.pt``: rank 0's ``torch.save`` of ``{"params": {name: full CPU tensor} (the
    trainable parameters), "optimizer": optimizer.state_dict(), **meta}``.

sharded (``scaling.strategy: fsdp``)
    A ``torch.distributed.checkpoint`` (DCP) folder of ``{"model": {name: parameter}
    (the trainable ones), "optim": optimizer state keyed by parameter name}``: every rank
    writes its own shards (``__<rank>_<n>.distcp``), rank 0 the ``.metadata`` index; nothing
    is gathered. Rank 0 also writes ``state.json``: the meta and ``"format":
    "llmdp-dcp-1"``. Every rank reports its own folder; Ray Train (v2) copies the folders
    reported at one step into one checkpoint folder (``LocalContext`` does the same). DCP
    reshards on load, so a checkpoint resumes on any number of workers.

The meta (small, no tensors): ``step``, ``run_id``, ``ledger`` (the ledger service's
position), ``scheduler`` (its state dict), ``strategy``, ``nonfinite_steps``, ``graceful``
(written by a graceful stop), and for a correlated mechanism ``noise``: its stream's
header (``t``, ``digest``, ``kind``, ``dtype``, ``totals``). The stream's tensors
(``llmdp.train.correlated``) are in ``state.pt`` (full) or, sharded like the parameters,
in the DCP folder under ``"noise"`` (``name#j``: buffer j of parameter ``name``'s state).

Every file is written atomically (a temporary name, fsync, rename) and each writer then
*seals* its folder (:func:`seal`): ``manifest.<rank>.json``, written last, holds every file's
size and sha256 (rank 0's also the number of writers). Ray Train's copy into storage is not
atomic, and a disk can truncate or flip what it holds: :func:`verify` is the one test of a
checkpoint, a folder whose manifests are missing or do not match its files is damaged (the
launch falls back to the newest intact one, ``llmdp.run.restore``; the worker refuses to
resume from one, :class:`CheckpointError`).

Readers that hold no process group (export, the CLI) read a sharded checkpoint's full
tensors one at a time (:func:`trainable_params`); :func:`check_model` is the export's check
that the final model holds exactly the last checkpoint's trainable parameters.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterator
from typing import Any

from llmdp._fs import atomic_write, sha256_file

FULL = "state.pt"
META = "state.json"
SHARDED = "llmdp-dcp-1"  # state.json's "format"
MANIFEST = "manifest.{rank}.json"  # written last by each writer (`seal`)
MANIFEST_FORMAT = "llmdp-ckpt-manifest-1"
# Checkpoints written before scaling strategies existed name none: they are replicated ones.
_DEFAULT_STRATEGY = "replicated"


def state_file(folder: str) -> str | None:
    """The file that makes ``folder`` a checkpoint (``state.json`` or ``state.pt``), or None."""
    for name in (META, FULL):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            return path
    return None


def read_meta(folder: str) -> dict[str, Any]:
    """The checkpoint's meta (no tensors), with ``"format"``: ``"full"`` or :data:`SHARDED`.
    ``FileNotFoundError`` if ``folder`` holds no checkpoint, ``ValueError`` if it is not one
    this version can read."""
    path = state_file(folder)
    if path is None:
        raise FileNotFoundError(f"{folder}: no checkpoint ({META} or {FULL})")
    if path.endswith(META):
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
        if meta.get("format") != SHARDED:
            raise ValueError(f"{path}: unknown checkpoint format {meta.get('format')!r} "
                             f"(this llmdp reads {SHARDED!r})")
        return meta
    import torch  # lazy: readers of a run directory do not need torch otherwise

    # mmap: the step and the ledger position are read, not the parameters or the optimizer.
    state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    meta = {k: v for k, v in state.items() if k not in ("params", "optimizer")}
    if isinstance(meta.get("noise"), dict):  # the correlated stream's header, not its tensors
        meta["noise"] = {k: v for k, v in meta["noise"].items() if k not in ("buffers", "shapes")}
    meta.setdefault("strategy", _DEFAULT_STRATEGY)
    return {**meta, "format": "full"}


def check_strategy(meta: dict, strategy: str, folder: str) -> None:
    """Refuse to resume a checkpoint written under another ``scaling.strategy``."""
    written = meta.get("strategy", _DEFAULT_STRATEGY)
    if written != strategy:
        raise ValueError(
            f"the checkpoint in {folder} was written with scaling.strategy: {written!r}; "
            f"resume it with the same strategy, not {strategy!r}")


class CheckpointError(RuntimeError):
    """A checkpoint that is damaged (its manifest is missing or does not match its files)."""


def write_full(folder: str, params: dict, optimizer_state: dict, meta: dict) -> None:
    """The full format (rank 0): ``state.pt``, written atomically."""
    import torch  # lazy: as above

    state = {"params": params, "optimizer": optimizer_state, **meta}
    atomic_write(os.path.join(folder, FULL), lambda f: torch.save(state, f))


def read_full(folder: str, map_location) -> dict:
    """The whole ``state.pt`` (parameters and optimizer state included)."""
    import torch  # lazy: as above

    return torch.load(os.path.join(folder, FULL), map_location=map_location)


def write_meta(folder: str, meta: dict) -> None:
    """The sharded format's ``state.json`` (rank 0, after the shards: DCP's ``save``
    returns once every rank has written its own and rank 0 the ``.metadata``)."""
    # a value JSON cannot hold fails here, loudly (before anything is written)
    data = json.dumps({**meta, "format": SHARDED}, indent=1).encode()
    atomic_write(os.path.join(folder, META), lambda f: f.write(data))


def _is_manifest(name: str) -> bool:
    return name.startswith("manifest.") and name.endswith(".json")


def seal(folder: str, rank: int, world: int, step: int) -> None:
    """This writer's manifest, written last (atomically): the size and sha256 of every file
    it wrote into ``folder`` (each writer writes its own folder; Ray Train, or
    `LocalContext`, merges them); rank 0's also says how many writers there are."""
    files = {}
    for root, _dirs, names in os.walk(folder):
        for name in sorted(names):
            path = os.path.join(root, name)
            rel = os.path.relpath(path, folder)
            if _is_manifest(name) or name.endswith(".tmp"):
                continue
            files[rel] = {"size": os.path.getsize(path), "sha256": sha256_file(path)}
    record = {"format": MANIFEST_FORMAT, "rank": rank, "step": int(step), "files": files}
    if rank == 0:
        record["writers"] = int(world)
    data = json.dumps(record, indent=1, sort_keys=True).encode()
    atomic_write(os.path.join(folder, MANIFEST.format(rank=rank)), lambda f: f.write(data))


def has_manifest(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, MANIFEST.format(rank=0)))


def verify(folder: str) -> str | None:
    """Why the checkpoint in ``folder`` is damaged (its manifests missing, unreadable, or not
    matching a file's size or sha256), or None: every file every writer sealed is there,
    whole. Reads every byte (sizes first: a truncated file is found without hashing)."""
    def manifest(rank: int) -> dict:
        path = os.path.join(folder, MANIFEST.format(rank=rank))
        if not os.path.isfile(path):
            raise CheckpointError(f"no {os.path.basename(path)} (written last: the checkpoint "
                                  f"was not completely written or copied)")
        try:
            with open(path, encoding="utf-8") as f:
                rec = json.load(f)
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{os.path.basename(path)} cannot be read ({e})") from None
        if not isinstance(rec, dict) or rec.get("format") != MANIFEST_FORMAT or \
                not isinstance(rec.get("files"), dict):
            raise CheckpointError(f"{os.path.basename(path)} is not a manifest of this llmdp")
        return rec

    try:
        first = manifest(0)
        writers = first.get("writers")
        if isinstance(writers, bool) or not isinstance(writers, int) or writers < 1:
            return f"{MANIFEST.format(rank=0)} names no number of writers"
        records = [first] + [manifest(r) for r in range(1, writers)]
        listed = [(rel, want) for rec in records for rel, want in sorted(rec["files"].items())]
        if not any(rel in (FULL, META) for rel, _ in listed):
            return f"its manifests list neither {FULL} nor {META}"
        for rel, want in listed:  # sizes first: cheap, and what a truncation changes
            path = os.path.join(folder, rel)
            if not os.path.isfile(path):
                return f"{rel} is missing"
            if os.path.getsize(path) != want.get("size"):
                return f"{rel} has {os.path.getsize(path)} bytes, its manifest says {want.get('size')}"
        for rel, want in listed:
            if sha256_file(os.path.join(folder, rel)) != want.get("sha256"):
                return f"{rel} does not match its sha256 in the manifest (its bytes changed)"
    except CheckpointError as e:
        return str(e)
    except OSError as e:
        return f"it cannot be read ({e})"
    return None


def _dcp_params(folder: str) -> list[tuple[str, str, Any]]:
    """(name, DCP key, tensor metadata) of the sharded checkpoint's trainable parameters."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = FileSystemReader(folder).read_metadata()
    paths = md.planner_data or {}
    out = []
    for key, tmd in md.state_dict_metadata.items():
        path = paths.get(key)
        if path is None or len(path) != 2 or path[0] != "model":
            continue
        if not isinstance(tmd, TensorStorageMetadata):
            raise ValueError(f"{folder}: {key!r} is not a tensor in the checkpoint")
        out.append((str(path[1]), key, tmd))
    return out


def trainable_params(folder: str) -> Iterator[tuple[str, Any]]:
    """The checkpoint's trainable parameters as full CPU tensors, one at a time, by name;
    no process group needed (a sharded checkpoint's pieces are read from every rank's
    file and assembled, one tensor in memory at a time)."""
    meta = read_meta(folder)
    if meta["format"] != SHARDED:
        yield from read_full(folder, "cpu")["params"].items()
        return
    import torch
    from torch.distributed.checkpoint import FileSystemReader, load

    for name, key, tmd in _dcp_params(folder):
        t = torch.empty(tuple(tmd.size), dtype=tmd.properties.dtype)
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            load({key: t}, storage_reader=FileSystemReader(folder), no_dist=True)
        yield name, t


def unreadable(e: Exception) -> str:
    return f"the last checkpoint cannot be read ({type(e).__name__}: {str(e)[:200]})"


def check_model(folder: str, model_dir: str) -> list[str]:
    """Problems (none: verified) with the claim that the saved model in ``model_dir`` (full
    weights, in one file or shards, or an adapter) holds exactly the trainable parameters
    of the checkpoint in ``folder``; each parameter is read and compared on its own."""
    import glob

    import torch
    from safetensors import safe_open

    saved: dict[str, str] = {}  # tensor key -> its safetensors file
    for path in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        with safe_open(path, framework="pt") as f:
            saved.update((k, path) for k in f.keys())
    if not saved:
        return [f"{model_dir} holds no safetensors weights"]
    try:
        for name, value in trainable_params(folder):
            # peft names adapter weights `...lora_A.default.weight` in memory, `...lora_A.weight` on disk.
            candidates = [name, name.replace(".default.", "."), name.replace("._orig_mod.", ".")]
            key = next((c for c in candidates if c in saved), None)
            if key is None:
                return [f"the final model lacks the checkpoint's parameter {name!r}: model/ and the "
                        f"last checkpoint are not the same training"]
            with safe_open(saved[key], framework="pt") as f:
                same = torch.equal(f.get_tensor(key).to(value.dtype), value)
            if not same:
                return [f"the final model's {name!r} differs from the last checkpoint's: model/ is "
                        f"not the model whose steps the ledger covers"]
    except Exception as e:  # noqa: BLE001 - a damaged checkpoint is a reason not to verify
        return [unreadable(e)]
    return []
