import os
import tempfile

import pytest

# Tests never share a cache (models, unit stores, dataset ledgers) with the user's runs or
# with an earlier test session: a dataset ledger is cumulative by design.
os.environ["LLMDP_CACHE"] = tempfile.mkdtemp(prefix="llmdp-test-cache-")
# ... nor a ledgers' database ($LLMDP_HOME/ledger.sqlite).
os.environ["LLMDP_HOME"] = tempfile.mkdtemp(prefix="llmdp-test-home-")
# ... nor the user's registry of ledger databases ($XDG_DATA_HOME/llmdp/ledger_databases.txt).
os.environ["XDG_DATA_HOME"] = os.environ["LLMDP_HOME"]

# Never reach a hub from tests: every model and tokenizer is built locally.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Ray Train's controller polls its workers every 2 s by default, so each launch waits up to
# a poll to see its workers start and another to see them finish; tests poll every 0.2 s
# (the controller's cadence only, nothing a test asserts; set before any Ray starts).
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")
# (Its preemption watcher is off on every local Ray llmdp starts, the tests' shared one
# included, and on as on any cluster in the multi-node tests: `localray.LOCAL_RAY_ENV`.)

# Under pytest-xdist (`make test` runs one worker per core), one thread per worker process:
# the workers already fill the cores, and torch's default (a thread per core in every
# process) would oversubscribe them. Set before torch is imported.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")


# dp-accounting's builders of a Gaussian step's PLD and RDP, memoized per test process on
# their exact arguments (`tests.helpers.memoize_accounting_steps`): the suite builds the
# same step many times (a test's direct dp-accounting reference and the product's plan of
# the same event, one recipe planned in several tests), 0.1-1.5 s per PLD: a quarter of
# the quick tests' CPU went to PLDs, a quarter of that to rebuilding one already built in
# the same process. A deterministic function of the same arguments gives the same result,
# so no number a test compares changes; what is kept is read-only, so a use that wrote
# into it would raise instead of passing its change on to the next test.
from tests.helpers import memoize_accounting_steps  # noqa: E402

memoize_accounting_steps()

# A test process ends with all it imported and built still on its heap (torch,
# transformers, Ray, the session's test objects): the interpreter's last garbage
# collections, after every exit handler, walk all of it, ~3 CPU-s per pytest-xdist worker
# that the controller waits for (py-spy: `gc_collect_main` during finalization). What
# exit handlers clean up (Ray, the forkserver, temporary folders) runs first, and
# pytest's own collections at the session's end (they report exceptions raised in
# finalizers) run before any exit handler: then the heap is frozen, out of the
# interpreter's reach, and the process exits. Registered here, before the handlers of
# what the tests import later, it runs after them.
if os.environ.get("PYTEST_XDIST_WORKER"):
    import atexit
    import gc

    atexit.register(gc.freeze)


@pytest.fixture(autouse=True, scope="module")
def _module_llmdp_home(tmp_path_factory):
    """Each test module its own ledgers' database and head log ($LLMDP_HOME), for its
    module-scoped fixtures: the generated corpora are the same bytes in every module, and a
    new ledger whose data has another ledger's content hash is refused (issue 29 item 5),
    as it would be for a user."""
    with pytest.MonkeyPatch.context() as mp:
        home = str(tmp_path_factory.mktemp("llmdp-home"))
        mp.setenv("LLMDP_HOME", home)
        mp.setenv("XDG_DATA_HOME", home)  # the registry of ledger databases, too
        yield


@pytest.fixture(autouse=True)
def _own_llmdp_home(_module_llmdp_home, tmp_path_factory, monkeypatch):
    """... and each test its own (see `_module_llmdp_home`)."""
    home = str(tmp_path_factory.mktemp("llmdp-home"))
    monkeypatch.setenv("LLMDP_HOME", home)
    monkeypatch.setenv("XDG_DATA_HOME", home)


# One local Ray per test process for the tests that launch runs in process and need no Ray
# of their own (`shared_ray`; tests.helpers.start_shared_ray): `ray.init`, its shutdown
# and a fresh Ray's first worker group cost ~15 s of this 2-core machine per launch. A
# launch finds it started and leaves it running (`launch._fit`); each run gives its workers
# its own environment (`localray.run_env`: the test switches as the test set them). A test
# that does not ask for it gets no Ray left by another: the shared one is stopped before it
# runs (tests of Ray's own start-up, clusters, subprocesses; a module-scoped Ray of a test
# module stops it itself, `stop_shared_ray`, before its `ray.init`).
@pytest.fixture
def shared_ray(tmp_path_factory):
    from tests.helpers import start_shared_ray

    start_shared_ray(lambda: str(tmp_path_factory.mktemp("shared-ray")))
    yield


@pytest.fixture(autouse=True)
def _no_foreign_ray(request):
    if "shared_ray" not in request.fixturenames:
        from tests.helpers import stop_shared_ray

        stop_shared_ray()
    yield


def pytest_collection_modifyitems(config, items):
    # The slow (Ray, end-to-end) tests first, in their order: the suite's last minutes are
    # then short tests, which the workers of `pytest -n` share out evenly, instead of one
    # worker finishing a two-minute test while the other waits. Among the slow ones, those
    # on the shared Ray first: they then run one after the other on one Ray, which a test
    # without it would otherwise stop in between (`_no_foreign_ray`; each stop and start
    # ~4 CPU-s). (A stable sort: every test's order among its own kind is unchanged.)
    items.sort(key=lambda item: (item.get_closest_marker("slow") is None,
                                 "shared_ray" not in getattr(item, "fixturenames", ())))
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # pragma: no cover
        has_cuda = False
    if has_cuda:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def pytest_sessionfinish(session, exitstatus):
    import shutil

    from tests.helpers import stop_shared_ray

    stop_shared_ray()

    shutil.rmtree(os.environ["LLMDP_CACHE"], ignore_errors=True)
    shutil.rmtree(os.environ["LLMDP_HOME"], ignore_errors=True)
