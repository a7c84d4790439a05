"""BalancedData's other input pipelines (sources.py): TFRecord files, tfds, a tf.data.Dataset.

Each source is checked against BalancedData's guarantees by building every rank's view in one
process: equal steps, rank i exactly b_i samples a step, every sample at most once an epoch and
all of them but the remainder, a fresh shuffle each epoch that every rank shares, plan changes
at segment boundaries and a resume that loses and repeats nothing; and each rank reads and
parses only its own records. Then the bad input: missing files, a corrupt record, a failing
parse function, compressed files, an empty split, a dataset that cannot be balanced.
"""
import os
import sys

import numpy as np
import pytest
import tensorflow as tf

from hvd_balance import Plan
from hvd_balance.keras import sources
from hvd_balance.keras.data import BalancedData

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "support"))
import record_files as rf  # noqa: E402

pytestmark = [pytest.mark.timeout(180), pytest.mark.stacks]

COUNTS = [37, 50, 13]  # 100 records in 3 files
N = sum(COUNTS)


@pytest.fixture()
def records(tmp_path):
    return rf.write_records(tmp_path / "records", COUNTS)


def tfrecord_views(files, plan, segment_steps=None, seed=3):
    views = [BalancedData.from_tfrecords(files, rf.parse_id, global_batch_size=plan.global_batch_size,
                                         seed=seed, rank=r, world_size=plan.world_size,
                                         segment_steps=segment_steps)
             for r in range(plan.world_size)]
    for v in views:
        v.set_plan(plan)
    return views


def epoch_ids(views, epoch):
    """Every rank's batches of record ids in ``epoch``, as its pipeline yields them."""
    out = []
    for v in views:
        v.set_epoch(epoch)
        out.append([b.numpy() for b in v])
    return out


def assert_exact_cover(per_rank, plan, universe_size, steps):
    assert [len(p) for p in per_rank] == [steps] * plan.world_size
    for r, batches in enumerate(per_rank):
        assert all(len(b) == plan.batch_sizes[r] for b in batches)
    seen = np.concatenate([np.concatenate(p) for p in per_rank])
    assert len(seen) == len(set(seen.tolist())) == steps * plan.global_batch_size
    assert set(seen.tolist()) <= set(range(universe_size))
    return seen


@pytest.mark.parametrize("sizes", [[3, 13], [1, 5, 10], [8, 8]])
def test_tfrecords_cover_every_record_once_an_epoch_fresh_shuffle_same_on_every_rank(records, sizes):
    plan = Plan.from_batch_sizes(sizes)
    views = tfrecord_views(records, plan)
    steps = N // plan.global_batch_size
    seen_by_epoch = []
    for epoch in range(3):
        per_rank = epoch_ids(views, epoch)
        seen_by_epoch.append(assert_exact_cover(per_rank, plan, N, steps))
        # Record k is global record number k: the pipeline yields exactly BalancedData's indices.
        for v, batches in zip(views, per_rank):
            assert all(np.array_equal(b, i) for b, i in zip(batches, v.indices(epoch)))
    assert not np.array_equal(seen_by_epoch[0], seen_by_epoch[1])  # a fresh shuffle
    again = epoch_ids(tfrecord_views(records, plan), 1)  # other processes, same seed: same shards
    assert np.array_equal(np.concatenate([np.concatenate(p) for p in again]), seen_by_epoch[1])


def test_each_rank_reads_only_its_own_records(records):
    plan = Plan.from_batch_sizes([2, 14])
    views = tfrecord_views(records, plan)
    epoch_ids(views, 0)
    record_bytes = len(rf.example(0)) + sources.HEADER_BYTES + sources.FOOTER_BYTES
    for v in views:
        own = v.local_samples
        # +1: the record parse_fn is checked on when the source is made.
        assert v.record_index.records_read == own + 1
        # ids 0..9 encode in one byte less than larger ones: the bytes are within that.
        assert abs(v.record_index.bytes_read - (own + 1) * record_bytes) <= own + 1


def test_tfrecords_plan_change_at_a_boundary_and_resume_in_another_world(records):
    old = tfrecord_views(records, Plan.from_batch_sizes([4, 4]), segment_steps=3)  # 12 steps
    for v in old:
        v.set_plan(Plan.from_batch_sizes([1, 7]), step=3)
    done = [np.concatenate([b.numpy() for b in v][:6]) for v in old]  # 6 steps committed
    new = tfrecord_views(records, Plan.from_batch_sizes([2, 2, 4]), segment_steps=3)
    rest = []
    for v in new:
        v.set_plan(Plan.from_batch_sizes([5, 2, 1]), step=6)
        batches = [b.numpy() for b in v.from_step(6)]
        assert len(batches) == 6
        rest.append(np.concatenate(batches))
    seen = np.concatenate(done + rest)
    assert len(seen) == 12 * 8 == len(set(seen.tolist()))
    order = old[0]._order(0)
    assert sorted(seen.tolist()) == sorted(order[:96].tolist())


def test_tfrecords_glob_list_and_index_cache(records, tmp_path, monkeypatch):
    by_glob = BalancedData.from_tfrecords(str(tmp_path / "records" / "part-*.tfrecord"), rf.parse_id,
                                          global_batch_size=10, rank=0, world_size=1, shuffle=False)
    assert np.array_equal(np.concatenate([b.numpy() for b in by_glob]), np.arange(N))
    # The index is cached beside the files; a second source reads no record to build it.
    assert all(os.path.exists(sources._index_path(p, None)) for p in records)
    monkeypatch.setattr(sources, "_record_lengths", lambda path: pytest.fail(f"rebuilt {path}"))
    cached = BalancedData.from_tfrecords(records, rf.parse_id, global_batch_size=10, rank=0,
                                         world_size=1, shuffle=False)
    assert np.array_equal(np.concatenate([b.numpy() for b in cached]), np.arange(N))
    monkeypatch.undo()
    # A rewritten file (new size and time) is indexed again; index_dir keeps the cache apart.
    rf.write_records(tmp_path / "records", [40, 50, 13])
    index_dir = tmp_path / "index"
    fresh = BalancedData.from_tfrecords(records, rf.parse_id, global_batch_size=10, rank=0,
                                        world_size=1, shuffle=False, index_dir=str(index_dir))
    assert fresh.num_samples == 103 and len(os.listdir(index_dir)) == 3


def test_tfrecords_train_a_keras_model(records):
    data = BalancedData.from_tfrecords(records, rf.parse_xy, global_batch_size=20, rank=0,
                                       world_size=1)
    model = tf.keras.Sequential([tf.keras.Input((2,)), tf.keras.layers.Dense(10)])
    model.compile(optimizer="sgd", loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = model.fit(data, epochs=2, verbose=0)
    assert len(history.history["loss"]) == 2 and np.isfinite(history.history["loss"]).all()


def test_missing_files_and_empty_glob_are_named(records, tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.tfrecord"):
        BalancedData.from_tfrecords(records + [str(tmp_path / "nope.tfrecord")], rf.parse_id,
                                    global_batch_size=10, rank=0, world_size=1)
    with pytest.raises(FileNotFoundError, match=r"no TFRecord file matches .*\*\.rec"):
        BalancedData.from_tfrecords(str(tmp_path / "*.rec"), rf.parse_id, global_batch_size=10,
                                    rank=0, world_size=1)


def test_a_corrupt_record_is_named_by_file_and_number(records):
    rf.corrupt_record(records[1], 17)
    with pytest.raises(ValueError, match=r"part-1\.tfrecord.*record 17 \(0-based\) is corrupt"):
        BalancedData.from_tfrecords(records, rf.parse_id, global_batch_size=10, rank=0, world_size=1)


def test_a_file_changed_after_indexing_is_refused_not_misread(records):
    data = BalancedData.from_tfrecords(records, rf.parse_id, global_batch_size=10, rank=0,
                                       world_size=1, shuffle=False)
    os.remove(records[2])
    rf.write_records(os.path.dirname(records[2]) + "/new", [1])
    os.replace(os.path.dirname(records[2]) + "/new/part-0.tfrecord", records[2])
    with pytest.raises(Exception, match=r"part-2\.tfrecord' changed since it was indexed"):
        list(data)


def test_compressed_records_are_refused(tmp_path):
    path = str(tmp_path / "z.tfrecord")
    with tf.io.TFRecordWriter(path, options="GZIP") as w:
        for i in range(20):
            w.write(rf.example(i))
    with pytest.raises(ValueError, match=r"z\.tfrecord.*or the file is compressed"):
        BalancedData.from_tfrecords([path], rf.parse_id, global_batch_size=10, rank=0, world_size=1)


def test_a_failing_parse_fn_is_refused_at_once(records):
    def bad_parse(record):
        return tf.io.parse_single_example(record, {"nope": tf.io.FixedLenFeature([], tf.int64)})

    with pytest.raises(ValueError, match=r"parse_fn failed on the first record of .*part-0"):
        BalancedData.from_tfrecords(records, bad_parse, global_batch_size=10, rank=0, world_size=1)


# -- tfds -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tfds_dir(tmp_path_factory):
    pytest.importorskip("tensorflow_datasets")
    folder = tmp_path_factory.mktemp("tfds")
    rf.prepare_tfds(folder)
    return str(folder)


def split_ids(data_dir, split):
    import tensorflow_datasets as tfds
    ds = tfds.load(rf.TFDS_NAME, split=split, data_dir=data_dir, shuffle_files=False)
    return sorted(int(ex["id"]) for ex in ds.as_numpy_iterator())


@pytest.mark.parametrize("split", ["train", "train[10:90]"])
def test_tfds_split_covered_once_an_epoch_by_the_builders_decoding(tfds_dir, split):
    plan = Plan.from_batch_sizes([5, 11])
    views = [BalancedData.from_tfds(rf.TFDS_NAME, split, global_batch_size=16, data_dir=tfds_dir,
                                    map_fn=lambda ex: (ex["id"], ex["image"], ex["label"]),
                                    rank=r, world_size=2) for r in range(2)]
    want = split_ids(tfds_dir, split)
    assert views[0].num_samples == len(want)
    steps = len(want) // 16
    for v in views:
        v.set_plan(plan)
    for epoch in range(2):
        per_rank = []
        for v in views:
            v.set_epoch(epoch)
            batches = list(v)
            for ids, image, label in batches:  # the builder's own decoding of each feature
                assert image.shape[1:] == (4, 4, 1) and image.dtype == tf.uint8
                np.testing.assert_array_equal(image.numpy()[:, 0, 0, 0], ids.numpy() % 256)
                np.testing.assert_array_equal(label.numpy(), ids.numpy() % 10)
            per_rank.append([b[0].numpy() for b in batches])
        seen = assert_exact_cover(per_rank, plan, rf.TFDS_TRAIN, steps)
        assert set(seen.tolist()) <= set(want)
        # Each rank read its own records (and the one decoded at the start), no more.
        assert [v.record_index.records_read for v in views] == \
            [(epoch + 1) * steps * b + 1 for b in plan.batch_sizes]


def test_tfds_as_supervised(tfds_dir):
    data = BalancedData.from_tfds(rf.TFDS_NAME, "test", global_batch_size=10, data_dir=tfds_dir,
                                  as_supervised=True, rank=0, world_size=1, shuffle=False)
    images, labels = next(iter(data))
    assert images.shape == (10, 4, 4, 1)
    np.testing.assert_array_equal(labels.numpy(), images.numpy()[:, 0, 0, 0] % 10)


def test_tfds_bad_input(tfds_dir, tmp_path):
    with pytest.raises(ValueError, match=r"split 'train\[:0\]' .* is empty"):
        BalancedData.from_tfds(rf.TFDS_NAME, "train[:0]", global_batch_size=10, data_dir=tfds_dir,
                               rank=0, world_size=1)
    with pytest.raises(ValueError, match="no split 'validation'"):
        BalancedData.from_tfds(rf.TFDS_NAME, "validation", global_batch_size=10, data_dir=tfds_dir,
                               rank=0, world_size=1)
    with pytest.raises(ValueError, match="not prepared"):
        BalancedData.from_tfds(rf.TFDS_NAME, "train", global_batch_size=10,
                               data_dir=str(tmp_path / "empty"), rank=0, world_size=1)


def test_tfds_missing_is_an_import_error_only_when_used(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)
    with pytest.raises(ImportError, match="needs tensorflow-datasets"):
        BalancedData.from_tfds("mnist", "train", global_batch_size=10, rank=0, world_size=1)


# -- an existing tf.data.Dataset ---------------------------------------------------------------
def dataset_views(dataset, plan, map_fn=None, steps_per_epoch=None, segment_steps=None):
    views = [BalancedData.from_dataset(dataset, global_batch_size=plan.global_batch_size,
                                       map_fn=map_fn, steps_per_epoch=steps_per_epoch,
                                       rank=r, world_size=plan.world_size, segment_steps=segment_steps)
             for r in range(plan.world_size)]
    for v in views:
        v.set_plan(plan)
    return views


def test_dataset_shuffled_with_a_seed_is_covered_once_and_mapped_only_on_own_elements():
    mapped = []

    def record(i):
        mapped.append(int(i))
        return i

    def map_fn(i, label):
        return tf.numpy_function(record, [i], tf.int64), label * 10

    def base():  # each rank builds its own: its k-th pass is every rank's k-th pass
        return tf.data.Dataset.range(103).shuffle(103, seed=7).map(lambda i: (i, i % 3))

    plan = Plan.from_batch_sizes([3, 13])
    views = [dataset_views(base(), plan, map_fn=map_fn)[r] for r in range(2)]
    reference = base().map(lambda i, label: i)  # one process's passes, one per epoch
    orders = []
    for epoch in range(2):
        per_rank = []
        for v in views:
            v.set_epoch(epoch)
            mapped.clear()
            batches = [(a.numpy(), b.numpy()) for a, b in v]
            assert sorted(mapped) == sorted(np.concatenate([a for a, _ in batches]).tolist())
            assert all(np.array_equal(b, (a % 3) * 10) for a, b in batches)
            per_rank.append([a for a, _ in batches])
        seen = assert_exact_cover(per_rank, plan, 103, 103 // 16)
        # Position p of the dataset's own order is sample p: rank r's block of positions.
        order = np.array(list(reference.as_numpy_iterator()))
        assert all(np.array_equal(b, order[i]) for v, p in zip(views, per_rank)
                   for b, i in zip(p, v.indices(epoch)))
        orders.append(seen)
    assert not np.array_equal(orders[0], orders[1])  # the dataset reshuffled itself, alike on each


def test_infinite_dataset_continues_across_epochs_and_resumes_at_a_boundary():
    base = tf.data.Dataset.range(10 ** 9).repeat()
    plan = Plan.from_batch_sizes([2, 6])
    views = dataset_views(base, plan, steps_per_epoch=6, segment_steps=2)
    for epoch in range(2):
        per_rank = []
        for v in views:
            v.set_epoch(epoch)
            per_rank.append([b.numpy() for b in v])
        seen = np.sort(np.concatenate([np.concatenate(p) for p in per_rank]))
        assert np.array_equal(seen, np.arange(epoch * 48, (epoch + 1) * 48))
    for v in views:
        v.set_plan(Plan.from_batch_sizes([7, 1]), step=4)
    rest = np.concatenate([np.concatenate([b.numpy() for b in v.from_step(4)]) for v in views])
    assert np.array_equal(np.sort(rest), np.arange(48 + 32, 96))


def test_dict_elements_without_map_fn():
    base = tf.data.Dataset.from_tensor_slices({"a": np.arange(40), "b": np.arange(40) * 2.0})
    (view,) = dataset_views(base, Plan.from_batch_sizes([8]))
    batches = list(view)
    assert len(batches) == 5
    np.testing.assert_array_equal(batches[1]["b"].numpy(), 2.0 * np.arange(8, 16))


def test_datasets_that_cannot_be_balanced_are_refused():
    kw = dict(global_batch_size=8, rank=0, world_size=1)
    with pytest.raises(ValueError, match="unknown leading dimension: a batched dataset"):
        BalancedData.from_dataset(tf.data.Dataset.range(100).batch(4), **kw)
    with pytest.raises(ValueError, match="infinite: give steps_per_epoch"):
        BalancedData.from_dataset(tf.data.Dataset.range(10).repeat(), **kw)
    with pytest.raises(ValueError, match="unknown: give steps_per_epoch"):
        BalancedData.from_dataset(tf.data.Dataset.range(100).filter(lambda i: i % 2 == 0), **kw)
    with pytest.raises(ValueError, match="steps_per_epoch=20 needs 160 elements; the dataset has 100"):
        BalancedData.from_dataset(tf.data.Dataset.range(100), steps_per_epoch=20, **kw)
    with pytest.raises(ValueError, match="5 elements, fewer than one global batch"):
        BalancedData.from_dataset(tf.data.Dataset.range(5), **kw)
    with pytest.raises(ValueError, match="takes no shuffle="):
        BalancedData.from_dataset(tf.data.Dataset.range(100), shuffle=True, **kw)
    ragged = tf.data.Dataset.range(1, 20).map(lambda n: tf.range(n))
    with pytest.raises(ValueError, match=r"shape \(None,\)"):
        BalancedData.from_dataset(ragged, **kw)
    # An unknown length with steps_per_epoch runs until the dataset ends early: named then.
    short = BalancedData.from_dataset(tf.data.Dataset.range(100).filter(lambda i: i < 20),
                                      steps_per_epoch=4, **kw)
    with pytest.raises(Exception, match="the dataset ended after 20 elements in epoch 0; 32"):
        list(short)
