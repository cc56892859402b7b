"""The conformance matrix (tests/conformance.py): every model kind under
every strategy shape, held to Keras' own `fit` on one device.

One device and Mirrored (2 logical CPUs) run here; MultiWorkerMirrored in
tests/test_fit_multiworker.py's two workers and parameter servers in the
shared cluster check their cells against the same reference with the same
`conformance.compare`.
"""

import json

import pytest

import conformance
import keras_dist as kd
from procs import CPUS


@pytest.fixture
def references(conformance_references):
    """Keras' own fit on one device, for every kind (tests/conftest.py)."""
    return conformance_references


@pytest.mark.parametrize("shape", ["one_device", "mirrored"])
@pytest.mark.parametrize("kind", conformance.KINDS)
def test_a_cell_conforms_to_keras_on_one_device(references, tmp_path, kind, shape):
    strategy = "default" if shape == "one_device" else kd.resolve_strategy(
        "mirrored", devices=CPUS)
    cell = json.loads(json.dumps(conformance.record(kind, conformance.kd_train(strategy),
                                                    tmp_path)))
    assert conformance.compare(cell, references[kind], kind, shape) == []


@pytest.mark.multiprocess
def test_parameter_server_cells_conform(request, shared_cluster, references):
    """Every kind with kd.fit on the shared cluster (chief, 2 workers, 1 ps:
    tests/scripts/ps_conformance.py)."""
    cells, _ = shared_cluster.result(request.node)
    problems = {kind: conformance.compare(cell, references[kind], kind, "parameter_server")
                for kind, cell in cells.items()}
    assert problems == {kind: [] for kind in conformance.KINDS}


def test_the_reference_is_what_the_matrix_assumes(references):
    """The reference itself: the custom step ran every step and logged its
    marker; every kind trained both epochs; Keras' own outcomes are the
    ones EXPECTED names for every shape (a trainer-mixin layer has no
    `save`)."""
    custom = references["custom_step"]
    steps = conformance.EPOCHS * conformance.EXAMPLES // conformance.BATCH
    assert custom["steps_run"] == steps
    assert custom["history_keys"][:3] == ["accuracy", "custom_marker", "loss"]
    assert custom["after"]["second_fit"]["ok"]["steps_run"] == steps
    for kind, reference in references.items():
        assert reference["epochs"] == conformance.EPOCHS, kind
        failed = {op for op, outcome in reference["after"].items() if "error" in outcome}
        assert failed == ({"save_and_load"} if kind == "trainer_mixin" else set()), \
            (kind, reference["after"])


def test_the_docs_matrix_is_the_one_expected(tmp_path):
    """docs/compatibility.md holds `make conformance-table`'s matrix."""
    with open("docs/compatibility.md") as f:
        page = f.read()
    assert conformance.table() in page, "run `make conformance-table`"
