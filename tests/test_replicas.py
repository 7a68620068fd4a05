"""Sparse tables under TensorFlow `MirroredStrategy` (2 logical CPU devices, 4 in
`make test-all`).

The runs happen in a child process (`tests/jobs/replicas_job.py`): the
logical devices are fixed when TensorFlow starts. Every replica gathers the
ids and row gradients of all replicas and applies the same summed update to
its own copy of each table: results equal one device at the global batch
(and Keras' own dense SGD under the same strategy), and every copy is the
same.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers import ROOT, THOROUGH, child_env, kinds

# Every run is a TensorFlow child's, whatever the session's backend: once, in the JAX
# session (to balance the sessions' times). (JAX shards tables with
# keras.distribution: tests/test_sharded.py.)
pytestmark = pytest.mark.jax_session

# Each replica traces the step again: 2 replicas (one of each kind: a batch
# split, a replica with no examples, an overflow on a replica other than the
# first) take the job 36 s instead of 54 s; `make test-all` runs 4.
REPLICAS = 4 if THOROUGH else 2
RUNS = kinds(["multi", "grouped"], ["multi"])


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    target = tmp_path_factory.mktemp("replicas")
    env = child_env("tensorflow")
    quick = [] if THOROUGH else ["--quick"]  # grouped tables too in `make test-all`
    proc = subprocess.run([sys.executable, "-m", "tests.jobs.replicas_job", str(target),
                           "--replicas", str(REPLICAS), *quick],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return target


def _npz(out, name):
    return np.load(os.path.join(out, f"{name}.npz"))


def _json(out, name):
    with open(os.path.join(out, f"{name}.json")) as f:
        return json.load(f)


def _paths(arrays, prefix):
    return sorted(k[len(prefix) + 1:] for k in arrays.files if k.startswith(prefix + "/"))


@pytest.mark.parametrize("run", RUNS)
def test_replicas_train_every_variable_like_one_device_at_the_global_batch(out, run):
    arrays, report = _npz(out, "fit"), _json(out, "fit")
    scratch = set(report["scratch"])
    want = [p for p in _paths(arrays, "single") if p not in scratch]
    assert any("accumulator" in p for p in want) and any("momentum" in p for p in want)
    for path in want:
        got = arrays[f"{run}/{path}@0"]
        np.testing.assert_allclose(got, arrays[f"single/{path}"], rtol=1e-5, atol=1e-6,
                                   err_msg=path)
    # It trained: every table moved.
    for path in [p for p in _paths(arrays, "init") if p.endswith("/embeddings")]:
        assert not np.array_equal(arrays[f"single/{path}"], arrays[f"init/{path}"]), path
    assert report[run]["dropped"] == report["single"]["dropped"]
    assert report["single"]["dropped"]["user/embeddings"] > 0
    assert report["single"]["dropped"]["tag/embeddings"] > 0
    assert report[run]["skipped"] == report["single"]["skipped"]
    groups = [["user/embeddings", "user2/embeddings"]] if run == "grouped" else []
    assert report[run]["groups"] == groups


@pytest.mark.parametrize("run", RUNS)
def test_every_replica_holds_the_same_copy_of_every_table_and_its_state(out, run):
    arrays = _npz(out, "fit")
    paths = sorted({k[len(run) + 1:].rsplit("@", 1)[0] for k in arrays.files
                    if k.startswith(run + "/")})
    assert any("embeddings" in p for p in paths)
    for path in paths:
        first = arrays[f"{run}/{path}@0"]
        for replica in range(1, REPLICAS):
            np.testing.assert_array_equal(arrays[f"{run}/{path}@{replica}"], first,
                                          err_msg=f"{path} replica {replica}")


def test_rows_no_replica_touched_stay_bit_for_bit(out):
    arrays = _npz(out, "fit")
    # "item" ids are drawn from its first 8 rows only.
    for run in ("multi", "grouped") if THOROUGH else ("multi",):
        for replica in range(REPLICAS):
            got = arrays[f"{run}/item/embeddings@{replica}"]
            np.testing.assert_array_equal(got[8:], arrays["init/item/embeddings"][8:])
            assert not np.array_equal(got[:8], arrays["init/item/embeddings"][:8])


def test_a_checkpoint_saved_by_replicas_loads_on_one_device_bit_for_bit(out):
    arrays, report = _npz(out, "fit"), _json(out, "fit")
    scratch = set(report["scratch"])
    loaded = [p for p in _paths(arrays, "loaded") if p not in scratch]
    assert any("momentum" in p for p in loaded)
    for path in loaded:
        np.testing.assert_array_equal(arrays[f"loaded/{path}"],
                                      arrays[f"{report['saved']}/{path}@0"], err_msg=path)


def test_accumulation_clipping_and_rate_callbacks_train_replicas_like_one_device(out):
    arrays = _npz(out, "controls")
    paths = _paths(arrays, "single")
    assert any("accumulated_ids" in p for p in paths) and any("embeddings" in p for p in paths)
    for path in paths:
        if "accumulated" in path or "dedup_workspace" in path:
            continue  # each replica's own micro-batches (a quarter of the ids); scratch
        np.testing.assert_allclose(arrays[f"multi/{path}"], arrays[f"single/{path}"],
                                   rtol=1e-5, atol=1e-6, err_msg=path)
        for replica in range(1, REPLICAS):
            np.testing.assert_array_equal(arrays[f"copies/{path}@{replica}"],
                                          arrays[f"copies/{path}@0"], err_msg=path)


def test_batches_that_split_unevenly_match_keras_dense_sgd_under_the_same_strategy(out):
    """64 + R / 2 examples by 16: the last batch gives half the replicas one example
    and the others none (1, 0 on 2 replicas; 1, 1, 0, 0 on 4)."""
    arrays = _npz(out, "uneven")
    assert 0 < arrays["examples"] % 16 < REPLICAS  # some replica gets no example
    for i in range(3):  # table, head kernel, head bias
        np.testing.assert_allclose(arrays[f"sparse/{i}"], arrays[f"dense/{i}"],
                                   rtol=1e-5, atol=1e-6)
    assert arrays["sparse/replicas_equal"]
    assert arrays["dense/replicas_equal"]


def test_loss_scaling_skips_the_step_everywhere_when_one_replica_overflows(out):
    """Step 2's loss is infinite on the last replica only. Keras' LossScaleOptimizer
    decides on replica 0's gradients; the tables' probe gradient carries the
    overflow of every replica, so the step is skipped on all of them."""
    arrays, report = _npz(out, "scaled"), _json(out, "scaled")
    assert report["multi"] == report["single"]
    assert report["single"]["scale"] == 2.0**9  # halved once
    for path in _paths(arrays, "single"):
        got = arrays[f"multi/{path}"]
        assert np.all(np.isfinite(got)), path
        np.testing.assert_allclose(got, arrays[f"single/{path}"], rtol=1e-5, atol=1e-6,
                                   err_msg=path)
    table = [arrays[f"copies/table/embeddings@{r}"] for r in range(REPLICAS)]
    for copy in table[1:]:
        np.testing.assert_array_equal(copy, table[0])


def test_a_replica_step_gathers_ids_and_rows_never_a_table_sized_tensor(out):
    """A custom loop's step (`strategy.run`) with a plain, a pooled and a keras-rs
    table of 9,973 rows: no op of the traced step outputs a table-sized
    dimension (a whole-table read or a dense gradient would)."""
    report = _json(out, "graph")
    assert report["table_sized"] == []
    assert report["ops"].get("CollectiveGatherV2", 0) > 0
    assert report["ops"].get("ResourceGather", 0) > 0
    assert report["changed_rows"] == {"plain/embeddings": 48, "bag/embeddings": 48,
                                      "de/rs/embeddings": 48}


# `make test` ("--quick"): a short last batch and accumulation; `make test-all` also a
# last batch that leaves some replicas empty.
@pytest.mark.parametrize("config", kinds(["plain", "uneven", "accumulated"],
                                         ["plain", "accumulated"]))
def test_an_open_vocabulary_on_replicas_is_one_device_at_the_global_batch(out, config):
    """Every replica works its map on every replica's ids in replica order, so the map
    (ids, rows, steps, totals, hand-over) is the one device's bit for bit, the table and
    its state train alike, and every copy is the same. (A last batch that leaves a
    replica empty: the map alone; Keras' loss weighs such a batch differently.)"""
    arrays, report = _npz(out, "vocabulary"), _json(out, "vocabulary")
    single, multi = report[f"{config}/single"], report[f"{config}/multi"]
    assert multi == single
    assert single["stats"]["admitted"] > 12 and single["stats"]["evicted"] > 0
    assert single["stats"]["default_lookups"] > 0
    # (Accumulation buffers hold each replica's own micro-batches; the dedup
    # workspace is scratch, positions in a buffer.)
    paths = [p for p in _paths(arrays, f"{config}/single")
             if "_accumulated_" not in p and not p.endswith("_dedup_workspace")]
    assert any("vocabulary_keys" in p for p in paths)
    for path in paths:
        want = arrays[f"{config}/single/{path}"]
        for replica in range(REPLICAS):
            got = arrays[f"{config}/copies/{path}@{replica}"]
            np.testing.assert_array_equal(got, arrays[f"{config}/copies/{path}@0"],
                                          err_msg=path)
        got = arrays[f"{config}/multi/{path}"]
        if np.issubdtype(want.dtype, np.integer) or "vocabulary_" in path:
            np.testing.assert_array_equal(got, want, err_msg=path)
        elif config != "uneven":
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=path)


def test_other_strategies_are_refused_naming_the_table_and_what_works(out):
    message = _json(out, "refused")["message"]
    assert message is not None
    assert "'e/embeddings'" in message and "2 replicas of tf.distribute.CentralStorageStrategy" \
        in message
    assert "MirroredStrategy" in message and "row_sharded" in message
