"""`.keras` files saved by an earlier keras_dist layout still load.

tests/data/saved-0.2.0.dev0/ was written by tools/make_saved_fixtures.py before
the modules moved into subpackages (issue 33). Loading must rebuild the same
classes, weights, optimizer state and predictions, and training must go on.
"""

import pathlib

import keras
import numpy as np
import pytest

import keras_dist as kd

SAVED = pathlib.Path(__file__).parent / "data" / "saved-0.2.0.dev0"
CASES = {
    "async_model_dynsgd": (kd.AsyncModel, ["DynSGD"]),
    "gap_aware_dana": (keras.Model, ["GapAware", "DANA"]),
    "dcasgd": (keras.Model, ["DCASGD"]),
    "staleness_limit_scaled": (keras.Model, ["StalenessLimit", "StalenessScaled"]),
}


def _chain(optimizer):
    names = []
    while isinstance(optimizer, kd.optimizers.StalenessAwareOptimizer):
        names.append(type(optimizer).__name__)
        optimizer = optimizer.inner_optimizer
    return names


@pytest.mark.filterwarnings("ignore:.*staleness of this update is unknown")
@pytest.mark.parametrize("name", sorted(CASES))
def test_file_saved_by_the_flat_layout_loads(name):
    model_class, chain = CASES[name]
    x = np.load(SAVED / "inputs.npy")
    model = keras.saving.load_model(SAVED / f"{name}.keras")
    assert isinstance(model, model_class)
    assert _chain(model.optimizer) == chain
    np.testing.assert_allclose(model.predict(x, verbose=0),
                               np.load(SAVED / f"{name}.predict.npy"), rtol=1e-6, atol=1e-6)
    assert int(model.optimizer.iterations.numpy()) == 2  # 16 examples, batch 8
    before = [w.copy() for w in model.get_weights()]
    model.fit(x, np.arange(16) % 3, epochs=1, batch_size=8, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 4
    assert any(not np.array_equal(a, b) for a, b in zip(before, model.get_weights()))
