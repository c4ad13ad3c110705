import os
import tempfile

import pytest

# Tests never share a cache (models, unit stores, dataset ledgers) with the user's runs or
# with an earlier test session: a dataset ledger is cumulative by design.
os.environ["LLMDP_CACHE"] = tempfile.mkdtemp(prefix="llmdp-test-cache-")
# ... nor a ledgers' database ($LLMDP_HOME/ledger.sqlite).
os.environ["LLMDP_HOME"] = tempfile.mkdtemp(prefix="llmdp-test-home-")

# Never reach a hub from tests: every model and tokenizer is built locally.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config, items):
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

    shutil.rmtree(os.environ["LLMDP_CACHE"], ignore_errors=True)
    shutil.rmtree(os.environ["LLMDP_HOME"], ignore_errors=True)
