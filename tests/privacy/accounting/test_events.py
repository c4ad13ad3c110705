import json

import dp_accounting as dpa
import pytest

from llmdp.privacy.accounting.events import (
    compose,
    dpsgd_step_event,
    event_from_json,
    event_to_json,
    is_truncated,
)


def _roundtrip(event):
    # Through an actual JSON string: what the ledger stores is text, not dicts.
    return event_from_json(json.loads(json.dumps(event_to_json(event))))


def test_step_event_is_poisson_sampled_gaussian():
    e = dpsgd_step_event(0.01, 1.1)
    assert e == dpa.PoissonSampledDpEvent(0.01, dpa.GaussianDpEvent(1.1))


@pytest.mark.parametrize(
    "event",
    [
        dpa.GaussianDpEvent(0.7),
        dpa.PoissonSampledDpEvent(0.0123, dpa.GaussianDpEvent(1.3)),
        dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(0.5, dpa.GaussianDpEvent(2.0)), 17),
        dpa.ComposedDpEvent(
            [
                dpa.SelfComposedDpEvent(
                    dpa.PoissonSampledDpEvent(0.1, dpa.GaussianDpEvent(0.9)), 3
                ),
                dpa.GaussianDpEvent(5.0),
                dpa.ComposedDpEvent([dpa.LaplaceDpEvent(0.3)]),
            ]
        ),
        dpa.TruncatedSubsampledGaussianDpEvent(15000, 256 / 15000, 334, 0.52),
        dpa.SelfComposedDpEvent(dpa.TruncatedSubsampledGaussianDpEvent(100, 0.1, 12, 1.5), 40),
        dpa.ComposedDpEvent(
            [
                dpa.SelfComposedDpEvent(dpsgd_step_event(0.1, 1.0), 3),
                dpa.SelfComposedDpEvent(
                    dpsgd_step_event(0.1, 1.0, dataset_size=1000, max_batch_size=130), 5
                ),
            ]
        ),
    ],
)
def test_json_roundtrip(event):
    d = event_to_json(event)
    assert d["class_name"] == type(event).__name__
    assert d["module_name"].startswith("dp_accounting")
    back = _roundtrip(event)
    assert back == event
    assert type(back) is type(event)


def test_json_keeps_all_fields_as_plain_types():
    e = dpa.SelfComposedDpEvent(dpsgd_step_event(0.25, 1.5), 9)
    d = event_to_json(e)
    assert d["count"] == 9
    assert d["event"]["sampling_probability"] == 0.25
    assert d["event"]["event"]["noise_multiplier"] == 1.5
    assert d["event"]["event"]["class_name"] == "GaussianDpEvent"
    c = event_to_json(dpa.ComposedDpEvent([dpa.GaussianDpEvent(1.0)]))
    assert isinstance(c["events"], list) and c["events"][0]["noise_multiplier"] == 1.0


def test_from_json_refuses_non_dp_accounting_classes():
    bad = {"module_name": "os", "class_name": "system"}
    with pytest.raises(ValueError, match="module_name"):
        event_from_json(bad)
    bad = {"module_name": "dp_accounting.dp_event", "class_name": "attr"}
    with pytest.raises(ValueError, match="class_name"):
        event_from_json(bad)


def test_compose_skips_zero_counts_and_self_composes():
    a, b = dpsgd_step_event(0.1, 1.0), dpsgd_step_event(0.2, 2.0)
    c = compose([(a, 5), (b, 0), (a, 2)])
    assert c == dpa.ComposedDpEvent([dpa.SelfComposedDpEvent(a, 5), dpa.SelfComposedDpEvent(a, 2)])
    assert _roundtrip(c) == c


def test_compose_rejects_bad_counts():
    with pytest.raises(ValueError, match="count"):
        compose([(dpsgd_step_event(0.1, 1.0), -1)])


@pytest.mark.parametrize(
    "q, sigma, name",
    [
        (0.0, 1.0, "sampling_probability"),
        (1.5, 1.0, "sampling_probability"),
        (0.1, 0.0, "noise_multiplier"),
    ],
)
def test_step_event_validation(q, sigma, name):
    with pytest.raises(ValueError, match=name):
        dpsgd_step_event(q, sigma)


def test_truncated_step_event():
    e = dpsgd_step_event(0.01, 1.1, dataset_size=5000, max_batch_size=80)
    # N = 5000 units sampled; the event carries the add-neighbour's size N + 1.
    assert e == dpa.TruncatedSubsampledGaussianDpEvent(
        dataset_size=5001, sampling_probability=0.01, truncated_batch_size=80, noise_multiplier=1.1
    )
    assert type(e.dataset_size) is int and type(e.truncated_batch_size) is int
    # The JSON keeps the library's field names and plain ints.
    d = json.loads(json.dumps(event_to_json(e)))
    assert d == {
        "module_name": "dp_accounting.dp_event",
        "class_name": "TruncatedSubsampledGaussianDpEvent",
        "dataset_size": 5001,
        "sampling_probability": 0.01,
        "truncated_batch_size": 80,
        "noise_multiplier": 1.1,
    }
    assert event_from_json(d) == e
    # dataset_size alone keeps the Poisson event (it does not depend on N).
    assert dpsgd_step_event(0.01, 1.1, dataset_size=5000) == dpsgd_step_event(0.01, 1.1)
    # A cap >= N is allowed (no truncation can happen).
    assert dpsgd_step_event(0.5, 1.0, dataset_size=10, max_batch_size=20).truncated_batch_size == 20


def test_is_truncated():
    t = dpsgd_step_event(0.1, 1.0, dataset_size=100, max_batch_size=20)
    p = dpsgd_step_event(0.1, 1.0)
    assert is_truncated(t) and not is_truncated(p)
    assert is_truncated(compose([(p, 3), (t, 2)])) and not is_truncated(compose([(p, 3)]))
    assert is_truncated(dpa.SelfComposedDpEvent(t, 4))


@pytest.mark.parametrize(
    "kwargs, fragments",
    [
        (dict(max_batch_size=10), ["dataset_size is required", "max_batch_size=10", "dataset_size=N"]),
        (dict(dataset_size=100, max_batch_size=0), ["max_batch_size must be an integer >= 1", "max_batch_size=0"]),
        (dict(dataset_size=100, max_batch_size=2.5), ["max_batch_size=2.5"]),
        (dict(dataset_size=100, max_batch_size=True), ["max_batch_size=True"]),
        (dict(dataset_size=0, max_batch_size=5), ["dataset_size must be an integer >= 1", "dataset_size=0"]),
        (dict(dataset_size=-3), ["dataset_size=-3"]),
    ],
)
def test_truncated_step_event_validation(kwargs, fragments):
    with pytest.raises(ValueError) as ei:
        dpsgd_step_event(0.1, 1.0, **kwargs)
    for f in fragments:
        assert f in str(ei.value), (f, str(ei.value))
