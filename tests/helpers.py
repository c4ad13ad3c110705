"""Shared test helpers: tiny tokenizers, tiny models, small corpora and unit stores.

Everything is built locally and fast (no network, no downloads). Import with
``from tests.helpers import tiny_llama, tiny_tokenizer, ...``.

- ``tiny_tokenizer_dir()``: a byte-level BPE (vocab 300) trained on a small *public*
  corpus, built once per test session; ``tiny_tokenizer()`` loads it (a fresh object).
- ``tiny_model(family, ...)`` / ``tiny_llama`` / ``tiny_gpt2`` / ``tiny_gemma`` /
  ``tiny_qwen2``: randomly initialized in-memory models (hidden 16, 2 layers, eager
  attention, dropout 0), seeded, in any dtype (float64 for reference checks).
  ``exact=True`` (float64 reference checks): transformers' Llama/Gemma/Qwen2 compute
  RMSNorm and the eager attention softmax in float32 even in a float64 model, which
  limits agreement to ~1e-7 relative; ``exact=True`` makes those run in the model's dtype
  (GPT-2 already does). See ``make_exact``.
- ``tiny_model_config(family, **overrides)``: an ``llmdp.config.schema.TinyModelConfig``.
- ``write_notes(path, n)``: a small synthetic private corpus (jsonl).
- ``tiny_store(cache_dir, ...)``: a built ``UnitStore`` over such a corpus.
- ``random_rows(...)``: a batch shaped like ``UnitStore.rows`` (with padding), no store needed.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile

import torch

TINY_VOCAB = 300
_SESSION_DIR: str | None = None
_TOKENIZER_DIRS: dict[int, str] = {}


def session_dir() -> str:
    """A temporary directory shared by the whole test session (removed at exit)."""
    global _SESSION_DIR
    if _SESSION_DIR is None:
        _SESSION_DIR = tempfile.mkdtemp(prefix="llmdp-tests-")
        atexit.register(shutil.rmtree, _SESSION_DIR, True)
    return _SESSION_DIR


# The head of the Ray tests' recipes (a ``str.format`` template: ``{tok}``, the tokenizer
# folder): a tiny llama built from its config; each test appends its data, privacy, optim,
# train, scaling and output sections.
TINY_MODEL_YAML = """
model:
  init: tiny
  tokenizer: {tok}
  tiny: {{hidden_size: 16, num_layers: 1, num_heads: 2, num_kv_heads: 1, intermediate_size: 32,
         max_position_embeddings: 64}}
"""


def tiny_tokenizer_dir(vocab_size: int = TINY_VOCAB) -> str:
    """Folder of a small public BPE tokenizer (trained once per session and vocab size)."""
    if vocab_size not in _TOKENIZER_DIRS:
        from llmdp.tokenizer.public import train_public_tokenizer

        out = os.path.join(session_dir(), f"tokenizer-{vocab_size}")
        _TOKENIZER_DIRS[vocab_size] = train_public_tokenizer(
            out, vocab_size=vocab_size, num_lines=1500, seed=0
        )
    return _TOKENIZER_DIRS[vocab_size]


def tiny_tokenizer(tmp_dir=None, vocab_size: int = TINY_VOCAB):
    """A fresh ``AutoTokenizer`` for the session's tiny tokenizer.

    With ``tmp_dir``, the folder is copied to ``tmp_dir/tokenizer`` first and loaded from
    there (for tests that need their own copy on disk).
    """
    from transformers import AutoTokenizer

    src = tiny_tokenizer_dir(vocab_size)
    if tmp_dir is not None:
        dst = os.path.join(os.fspath(tmp_dir), "tokenizer")
        if not os.path.isdir(dst):
            shutil.copytree(src, dst)
        src = dst
    return AutoTokenizer.from_pretrained(src)


def tiny_model_config(family: str = "llama", **overrides):
    """An ``llmdp.config.schema.TinyModelConfig`` with test-sized defaults."""
    from llmdp.config.schema import TinyModelConfig

    kw = dict(family=family, hidden_size=16, num_layers=2, num_heads=4, num_kv_heads=2,
              intermediate_size=32, max_position_embeddings=64, tie_word_embeddings=False, seed=0)
    kw.update(overrides)
    return TinyModelConfig(**kw)


EXACT_ATTN = "eager_native_dtype"


def _eager_native_dtype(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                        **kwargs):
    """Eager attention with the softmax in the inputs' dtype (transformers' Llama/Gemma/Qwen2
    eager path upcasts it to float32 and back, losing float64 precision)."""
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:
        b, h, t, d = key.shape
        key = key[:, :, None].expand(b, h, groups, t, d).reshape(b, h * groups, t, d)
        value = value[:, :, None].expand(b, h, groups, t, d).reshape(b, h * groups, t, d)
    if scaling is None:
        scaling = query.size(-1) ** -0.5
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        weights = weights + attention_mask
    weights = torch.nn.functional.softmax(weights, dim=-1)
    weights = torch.nn.functional.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


_EXACT_REGISTERED = False


def _register_exact_attention() -> None:
    global _EXACT_REGISTERED
    if not _EXACT_REGISTERED:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, eager_mask

        AttentionInterface.register(EXACT_ATTN, _eager_native_dtype)
        AttentionMaskInterface.register(EXACT_ATTN, eager_mask)
        _EXACT_REGISTERED = True


def _rms_norm_native(self, x):
    eps = getattr(self, "variance_epsilon", getattr(self, "eps", 1e-6))
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    if type(self).__name__.startswith("Gemma"):
        return y * (1.0 + self.weight)  # Gemma scales by (1 + w)
    return self.weight * y


class _NoFloat32(torch.overrides.TorchFunctionMode):
    """Casts of a float64 tensor to float32 left out (the tensor itself), inside a module
    whose forward casts its operands: DeepSeek-V3's and GLM-4-MoE's routers take their
    logits with ``F.linear(h.type(torch.float32), w.type(torch.float32))``, a float32 GEMM
    whose rounding depends on how many tokens it is given (the BLAS picks its kernel by
    shape), so a unit's rows alone and the whole batch would route with different float32
    scores on some machines: not a per-unit difference the engine can see."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.Tensor.type, torch.Tensor.to, torch.Tensor.float) and args \
                and isinstance(args[0], torch.Tensor) and args[0].dtype == torch.float64:
            target = (torch.float32 if func is torch.Tensor.float else
                      kwargs.get("dtype", args[1] if len(args) > 1 else None))
            if target in (torch.float32, "torch.FloatTensor"):
                return args[0]
        return func(*args, **kwargs)


def _native_dtype_forward(module):
    orig = module.forward

    def forward(*a, **k):
        with _NoFloat32():
            return orig(*a, **k)

    return forward


def make_exact(model):
    """Make RMSNorm, eager attention and the grouped top-k routers compute in the model's own
    dtype (in place).

    For float64 reference checks only: the math is the same as transformers', without
    the float32 round trips. Patches instances (not classes) and sets the attention
    implementation to a registered native-dtype eager function (works under torch.func).
    """
    import types

    _register_exact_attention()
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.forward = types.MethodType(_rms_norm_native, module)
        elif type(module).__name__.endswith("TopkRouter"):  # DeepSeek-V3, GLM-4-MoE
            module.forward = _native_dtype_forward(module)
    if model.config.model_type != "gpt2":  # GPT-2's eager path is already native-dtype
        model.set_attn_implementation(EXACT_ATTN)
    return model


def tiny_model(family: str = "llama", *, vocab_size: int = 64, dtype=torch.float32,
               attn_implementation: str = "eager", exact: bool = False, pad_token_id: int = 2,
               bos_token_id: int = 0, eos_token_id: int = 1, **overrides):
    """A randomly initialized in-memory tiny causal LM (seeded by ``seed``, default 0).

    ``exact=True``: see :func:`make_exact` (use with ``dtype=torch.float64``).
    """
    from transformers import AutoModelForCausalLM

    from llmdp.train.models import tiny_hf_config

    cfg = tiny_model_config(family, **overrides)
    hf = tiny_hf_config(cfg, vocab_size, pad_token_id, bos_token_id, eos_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = AutoModelForCausalLM.from_config(hf, attn_implementation=attn_implementation)
    model = model.to(dtype)
    return make_exact(model) if exact else model


def tiny_llama(**kw):
    return tiny_model("llama", **kw)


def tiny_gpt2(**kw):
    return tiny_model("gpt2", **kw)


def tiny_gemma(**kw):
    return tiny_model("gemma", **kw)


def tiny_qwen2(**kw):
    return tiny_model("qwen2", **kw)


def write_notes(path, num_documents: int = 40, seed: int = 0) -> str:
    """A small synthetic private corpus (jsonl with doc_id, user_id, author, date, text)."""
    from llmdp.data.synthetic import generate_clinical_notes, write_jsonl

    return write_jsonl(generate_clinical_notes(num_documents, seed), path)


def tiny_store(cache_dir, *, num_documents: int = 40, sequence_length: int = 32, seed: int = 0,
               tokenizer=None, unit_fraction: float | None = None):
    """A built ``UnitStore`` over ``write_notes`` (corpus written into ``cache_dir``)."""
    from llmdp.data.store import build_store
    from llmdp.data.units import UnitSpec

    cache_dir = os.fspath(cache_dir)
    os.makedirs(cache_dir, exist_ok=True)
    data = os.path.join(cache_dir, f"notes-{num_documents}-{seed}.jsonl")
    if not os.path.exists(data):
        write_notes(data, num_documents, seed)
    return build_store(
        os.path.join(cache_dir, "units"), data_path=data, data_format="auto", text_field="text",
        tokenizer=tokenizer if tokenizer is not None else tiny_tokenizer(),
        spec=UnitSpec(sequence_length=sequence_length), unit_fraction=unit_fraction,
    )


def random_rows(num_rows: int, sequence_length: int, vocab_size: int = 64, *, seed: int = 0,
                lengths=None, pad_id: int = 2) -> dict[str, torch.Tensor]:
    """A batch in the ``UnitStore.rows`` format with random tokens.

    ``lengths[r]`` real tokens in row r (default: the last row is half padding).
    """
    g = torch.Generator().manual_seed(seed)
    L = sequence_length
    if lengths is None:
        lengths = [L] * num_rows
        if num_rows:
            lengths[-1] = max(2, L // 2)
    lengths = torch.as_tensor(lengths, dtype=torch.int64)
    tokens = torch.randint(0, vocab_size, (num_rows, L), generator=g)
    mask = (torch.arange(L).unsqueeze(0) < lengths.unsqueeze(1)).long()
    input_ids = torch.where(mask.bool(), tokens, torch.full_like(tokens, pad_id))
    labels = torch.where(mask.bool(), tokens, torch.full_like(tokens, -100))
    return {
        "input_ids": input_ids,
        "attention_mask": mask,
        "labels": labels,
        "row_units": torch.arange(num_rows, dtype=torch.int64),
        "num_target_tokens": (labels[:, 1:] != -100).sum(dim=1),
    }


def dataset_records(location, data_path=None, dataset_id=None) -> list[dict]:
    """The verified records of a dataset ledger (``dataset_id``, or the id derived from a
    local ``data_path``) in the database at ``location`` (None: the default)."""
    import os as _os

    from llmdp.privacy.ledger.database import LedgerDB
    from llmdp.privacy.ledger.location import resolve_location

    ds = dataset_id or "path:" + _os.path.realpath(str(data_path))
    db = LedgerDB(resolve_location(None if location is None else str(location)))
    try:
        return db.records(ds)
    finally:
        db.close()


def dataset_entries(location, data_path=None, dataset_id=None):
    from llmdp.privacy.ledger.budget import release_entries_of

    return release_entries_of(dataset_records(location, data_path, dataset_id))


def simulate_steps(prepared, steps=None) -> None:
    """Write a prepared run's steps to its ledgers as the ledger service does (no training)."""
    from llmdp.privacy.ledger.service import LedgerService

    svc = LedgerService(**prepared.ledger.service)
    svc.start_attempt()
    for s in range(prepared.plan.steps if steps is None else steps):
        svc.ensure(s)
    svc.db.close()


def use_noise_cap(monkeypatch, radius_bits: int) -> tuple[float, float]:
    """Model a noise generator whose radius uniform has ``radius_bits`` bits: pairs truncated
    at τ = sqrt(2·bits·ln 2), mass m = 2**-bits removed from each (`llmdp.privacy.noise.tail`;
    the modules that state τ too). The generator draws 106 bits, whose tails are negligible
    at any usable σ; tests of the machinery that folds tails into δ use 53 (the earlier
    generator), where they show in ε at usual σ. Returns (m, τ)."""
    import math

    from llmdp.privacy import plan
    from llmdp.privacy.noise import tail as noise_tail
    from llmdp.report import build as report

    mass, tau = 2.0**-radius_bits, math.sqrt(2 * radius_bits * math.log(2))
    monkeypatch.setattr(noise_tail, "TAIL_MASS", mass)
    for module in (noise_tail, plan, report):
        monkeypatch.setattr(module, "NOISE_TAIL", tau)
    return mass, tau


# ------------------------------------------------------------------ dp-accounting's steps, built once

#: Results kept per test process and function (a PLD: two pmfs of up to ~250k floats, a
#: few MB; an RDP vector: one float per order).
ACCOUNTING_MEMO_SIZE = 32
_PLD_CONSTRUCTORS = ("from_gaussian_mechanism", "from_truncated_subsampled_gaussian_mechanism")


def memoize_accounting_steps() -> None:
    """dp-accounting's builders of one Gaussian step, as every caller reaches them (a module
    attribute: llmdp's accountant and dp-accounting's own accountants), memoized in this
    process on their exact arguments: the PLD constructors (plain, Poisson-subsampled,
    truncated) and the Poisson-subsampled Gaussian's RDP vector. The arguments are bound to
    the signature with its defaults, each value keyed with its type (0.5 as a float and as
    a float32 are another call; the RDP orders by their values and dtype). The same call of
    a deterministic function returns the same result, so a memoized one is the very object
    it would have built again: no number changes, and calls with any argument different
    are still two builds, so a test comparing llmdp with dp-accounting still compares two
    computations wherever their arguments differ. What is kept is made read-only (a PLD's
    pmf arrays, the RDP vector), so a use that wrote into it would raise, not hand its
    change on to a later caller."""
    from dp_accounting.pld import privacy_loss_distribution as pld
    from dp_accounting.rdp import rdp_privacy_accountant as rdp

    for name in _PLD_CONSTRUCTORS:
        _memoize(pld, name, _read_only_pld)
    _memoize(rdp, "_compute_rdp_poisson_subsampled_gaussian", _read_only_array)


def _memoize(module, name: str, read_only) -> None:
    import functools
    import inspect
    from collections import OrderedDict

    import numpy as np

    build = getattr(module, name)
    if getattr(build, "memoized", False):
        return
    signature = inspect.signature(build)
    kept: OrderedDict = OrderedDict()

    def key_of(value):
        if isinstance(value, np.ndarray):
            return (np.ndarray, value.dtype.str, value.shape, value.tobytes())
        if isinstance(value, (list, tuple)):
            return (type(value), tuple(key_of(v) for v in value))
        return (type(value), value)

    def memoized(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        try:
            key = tuple((k, key_of(v)) for k, v in bound.arguments.items())
            hit = kept.get(key)
        except TypeError:  # an unhashable argument: built as it is
            return build(*args, **kwargs)
        if hit is None:
            hit = kept[key] = read_only(build(*args, **kwargs))
            while len(kept) > ACCOUNTING_MEMO_SIZE:
                kept.popitem(last=False)
        else:
            kept.move_to_end(key)
        return hit

    functools.update_wrapper(memoized, build)
    memoized.memoized = True
    setattr(module, name, memoized)


def _read_only_pld(distribution):
    for pmf in (getattr(distribution, "_pmf_remove", None), getattr(distribution, "_pmf_add", None)):
        _read_only_array(getattr(pmf, "_probs", None))
    return distribution


def _read_only_array(value):
    if hasattr(value, "flags"):
        value.flags.writeable = False
    return value


# ------------------------------------------------------------------ one Ray per test process

_SHARED_RAY: dict = {}

#: CPUs of the shared Ray: the largest test launch (2 workers x 1 CPU, and the driver's side).
SHARED_RAY_CPUS = 4


def start_shared_ray(where) -> None:
    """The test process's one local Ray (conftest's ``shared_ray``), started on first use;
    ``where()`` gives the folder of its watchdog's record. A Ray someone else started is
    used as it is."""
    import ray

    if "local" in _SHARED_RAY or ray.is_initialized():
        return
    from llmdp.base import localray

    _SHARED_RAY["local"] = localray.start_local_ray(where(), [], lambda *a: None,
                                                    num_cpus=SHARED_RAY_CPUS)


def stop_shared_ray() -> None:
    """Stop the shared Ray if it runs (a test that needs its own Ray, or none)."""
    if "local" not in _SHARED_RAY:
        return
    import ray

    local = _SHARED_RAY.pop("local")
    ray.shutdown()
    if local is not None:
        local.stop()


# ------------------------------------------------------------------ worker processes


# What the tests' worker processes (gloo process groups, the ledger's concurrent clients)
# import: loaded once into multiprocessing's forkserver of this test process, so that each
# process forked from it starts with them (a spawned one imports torch, transformers' model
# code and the training loop again: ~11 s of this machine's CPU per process). Set before
# the server starts (one per test process, shared by every user of the "forkserver"
# context; a module missing here is imported by the process that needs it).
FORKSERVER_PRELOAD = [
    "torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.fsdp",
    "transformers", "transformers.modeling_utils", "transformers.models.llama.modeling_llama",
    "llmdp.clipping", "llmdp.data.store", "llmdp.train.loop", "llmdp.train.parallel",
    "llmdp.privacy.ledger.service", "tests.helpers",
    "tests.privacy.ledger.test_ledger_stress", "tests.privacy.ledger.test_dataset_budget",
]


def forkserver():
    """multiprocessing's "forkserver" context, its server to preload ``FORKSERVER_PRELOAD``."""
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD + COMMAND_PRELOAD)
    return ctx


def start_processes(fn, args: tuple, nprocs: int) -> None:
    """``torch.multiprocessing.start_processes(fn, args, nprocs, join=True)`` from the
    forkserver (``forkserver``): ``fn(rank, *args)`` in each process, with this process's
    environment and working directory, as a spawned process has them (a forked one would
    have the server's: it started with the first test that used it)."""
    import torch.multiprocessing as mp

    forkserver()
    mp.start_processes(_as_spawned, args=(fn, dict(os.environ), os.getcwd(), args), nprocs=nprocs,
                       join=True, start_method="forkserver")


def in_script(rank, path: str, name: str, *args):
    """``name(rank, *args)`` of the script at ``path`` (a benchmark: a file, not an
    importable module), loaded in this process: what ``start_processes`` runs for a
    script's worker function (pickled by its name, which a forked process cannot import)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"_script_{os.path.basename(path)[:-3]}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)(rank, *args)


def _as_spawned(rank, fn, env, cwd, args):
    _adopt(env, cwd)
    fn(rank, *args)


def _adopt(env: dict, cwd: str) -> None:
    """A forked process takes the caller's environment and working directory (it has the
    forkserver's, from the test that started the server)."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)


# What a forked `llmdp` command imports beyond the workers' modules: the driver's launch,
# planning (HF datasets), report and export. Not Ray: it reads some of its settings
# (RAY_TMPDIR, RAY_ADDRESS) from the environment of the process that imports it.
COMMAND_PRELOAD = ["llmdp.cli", "llmdp.run.launch", "llmdp.run.planning", "llmdp.report.build",
                   "llmdp.hub.export", "matplotlib.pyplot"]


class Command:
    """``python -m llmdp.cli *args`` as a process of its own, forked from this test process's
    forkserver (`forkserver`: torch, transformers and llmdp already imported, ~6 CPU-s less
    per launch than a fresh interpreter) into the environment and working directory given,
    in a session of its own where asked (a terminal's Ctrl-C reaches its process group).
    Its stdout and stderr go to the file ``log`` (appended). What a test does with a
    `subprocess.Popen`: ``pid``, ``poll``, ``wait``, ``returncode`` (negative: the signal
    that ended it), ``send_signal``, ``kill``; ``output()`` reads the log."""

    def __init__(self, args, *, cwd, log, env=None, new_session: bool = False):
        self.log = str(log)
        ctx = forkserver()
        self._p = ctx.Process(target=_run_command, args=(
            [str(a) for a in args], str(cwd), dict(os.environ if env is None else env), self.log,
            new_session))
        self._p.start()
        self.pid = self._p.pid

    @property
    def returncode(self) -> int | None:
        return self._p.exitcode

    def poll(self) -> int | None:
        return self._p.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._p.join(timeout)
        if self._p.exitcode is None:
            raise subprocess.TimeoutExpired(f"llmdp (pid {self.pid})", timeout)
        return self._p.exitcode

    def send_signal(self, sig: int) -> None:
        if self._p.exitcode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        import signal

        self.send_signal(signal.SIGKILL)

    def output(self) -> str:
        with open(self.log, errors="replace") as f:
            return f.read()


def _run_command(args, cwd, env, log, new_session):
    if new_session:
        os.setsid()
    _adopt(env, cwd)
    _output_to(log, (1, 2), os.O_APPEND)
    sys.argv = ["llmdp", *args]
    from llmdp.cli import main

    sys.exit(main(args))  # the exit code; multiprocessing flushes stdout and stderr


def _output_to(path: str, fds: tuple[int, ...], mode: int) -> None:
    """This process's file descriptors ``fds`` (1: stdout, 2: stderr) write to ``path``
    (``mode``: ``os.O_APPEND`` or ``os.O_TRUNC``), owner-only."""
    f = os.open(path, os.O_WRONLY | os.O_CREAT | mode, 0o600)
    for fd in fds:
        os.dup2(f, fd)
    os.close(f)


class ForkedScripts:
    """A benchmark script's ``subprocess`` module, for tests: ``run([sys.executable,
    SCRIPT, *args], env=..., timeout=...)`` runs ``python SCRIPT *args`` in a process forked
    from the forkserver (`forkserver`: torch, transformers and llmdp already imported,
    ~3.5 CPU-s less per child than a fresh interpreter) and returns what
    ``subprocess.run(..., capture_output=True, text=True)`` returns. The child runs the
    script as ``__main__`` with the environment and working directory given, its stdout and
    stderr captured, and the environment's PYTHONPATH ahead on its ``sys.path`` as a fresh
    interpreter puts it; what a fresh interpreter reads only as it starts (glibc's
    ``MALLOC_*``) is the forkserver's. A test sets it on the script's module
    (``monkeypatch.setattr(module, "subprocess", ForkedScripts)``); the script itself is
    unchanged."""

    TimeoutExpired = subprocess.TimeoutExpired
    CompletedProcess = subprocess.CompletedProcess

    @staticmethod
    def run(cmd, *, capture_output=True, text=True, timeout=None, env=None, cwd=None):
        if not (capture_output and text and len(cmd) >= 2 and cmd[0] == sys.executable
                and str(cmd[1]).endswith(".py")):
            raise ValueError(f"ForkedScripts.run runs `python SCRIPT.py ...` with its output "
                             f"captured as text, got {cmd!r}")
        with tempfile.TemporaryDirectory(prefix="llmdp-forked-script-") as d:
            out, err = os.path.join(d, "stdout"), os.path.join(d, "stderr")
            p = forkserver().Process(target=_run_script, args=(
                [str(a) for a in cmd[1:]], str(cwd or os.getcwd()),
                dict(os.environ if env is None else env), out, err))
            p.start()
            p.join(timeout)
            timed_out = p.exitcode is None
            if timed_out:
                p.kill()
                p.join()

            def read(path):
                with open(path, errors="replace") as f:
                    return f.read()

            if timed_out:
                raise ForkedScripts.TimeoutExpired(cmd, timeout, output=read(out), stderr=read(err))
            return ForkedScripts.CompletedProcess(cmd, p.exitcode, read(out), read(err))


def _run_script(argv, cwd, env, out, err):
    import runpy

    _adopt(env, cwd)
    _output_to(out, (1,), os.O_TRUNC)
    _output_to(err, (2,), os.O_TRUNC)
    script = os.path.abspath(argv[0])
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [os.path.dirname(script), *extra, *sys.path[1:]]
    sys.argv = [script, *argv[1:]]
    runpy.run_path(script, run_name="__main__")  # exits as the script exits (SystemExit)


# ------------------------------------------------------------------ Triton's interpreter


def run_interpreted(script: str, timeout: float = 3600) -> subprocess.CompletedProcess:
    """``python -c script`` in a fresh interpreter with ``TRITON_INTERPRET=1``, the
    repository on its path and as its working directory, its output captured as text.
    Fresh, not forked from the tests' forkserver (`ForkedScripts`): Triton must be imported
    with ``TRITON_INTERPRET`` set, and the server imported it without (its own @jit library
    functions then refuse to run inside an interpreted kernel). ``timeout`` only guards
    against a hang: the interpreter runs every kernel program in Python, minutes on a quiet
    machine, many more on a loaded one.

    The script runs after lines that turn off the interpreter's integer-overflow sanitizer.
    By default the interpreter does every add, subtract and multiply of integers narrower
    than 64 bits a second time in int64 and forms the check that the result fits, then
    hands it to ``device_assert``, which asserts nothing unless the interpreter runs in
    debug mode (``options.debug``, off here and in these tests): the check could never
    fail, and forming it was a third of these tests' time. (Compiled kernels do not have it
    either: Triton's CUDA backend leaves it off unless debugging is asked for. Offsets past
    2^31 are the kernels' own int64 arithmetic: the ChaCha kernels' indices, the row-norm
    and tile kernels' WIDE switch.) A Triton without that setting runs the script as it is."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    prelude = (
        "import dataclasses as _dc\n"
        "import triton.runtime.interpreter as _ti\n"
        "_b = getattr(_ti, 'interpreter_builder', None)\n"
        "if _dc.is_dataclass(getattr(_b, 'options', None)) and hasattr(_b.options, 'sanitize_overflow'):\n"
        "    _b.options = _dc.replace(_b.options, sanitize_overflow=False)\n"
        "del _dc, _ti, _b\n"
    )
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=root)
    return subprocess.run([sys.executable, "-c", prelude + script], env=env, capture_output=True,
                          text=True, timeout=timeout, cwd=root)


# ------------------------------------------------------------------ import graphs


def import_cycles(edges) -> list[list[str]]:
    """The strongly connected components of more than one node of a graph ``edges`` (node ->
    its successors, any iterable or mapping), each sorted: import cycles, of modules
    (tests/test_imports.py) or of packages (tests/test_layers.py). Iterative Tarjan."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in sorted(set(edges) | {w for s in edges.values() for w in s}):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out
