"""Input sources for BalancedData that are not arrays in memory; each rank decodes only its own.

* **TFRecord files** (``BalancedData.from_tfrecords``): a ``RecordIndex`` lists every
  record's file, byte offset and length. It is built once per file by one sequential read with
  ``tf.data``'s reader, which checks every record's CRCs (cost: reading the file once), and
  cached beside the file or in ``index_dir`` (16 bytes a record), keyed by the file's size and
  modification time. A record's key is its number in the index, so the sharding is
  ``BalancedData``'s key/``load_fn`` path unchanged, and each rank reads exactly its records,
  one positioned read (``os.pread``) of ``length`` bytes each: random reads, a seek per
  record on a disk, none on a page-cached or solid-state file.
* **TensorFlow Datasets** (``from_tfds``): a prepared builder's TFRecord shards (its split's
  file instructions: which records of which shard) and its own feature decoding, read as above.
* **A tf.data.Dataset** (``from_dataset``): a forward-only ``DatasetStream``; every rank
  iterates the un-mapped elements and keeps those at its positions under ``BalancedData``'s
  rule (the dataset's order is the unshuffled sample order), so ``map_fn`` runs only on them.

This module does not import ``data.py``: ``BalancedData``'s class methods pass their class in.
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import os
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

log = logging.getLogger(__name__)

# TFRecord framing: uint64 length, uint32 masked CRC of the length, data, uint32 masked CRC
# of the data (tensorflow/core/lib/io/record_writer.cc).
HEADER_BYTES = 12
FOOTER_BYTES = 4
INDEX_SUFFIX = ".hvd_balance_index.npz"
INDEX_FORMAT = 1


# -- TFRecord files ---------------------------------------------------------------------------
def expand_files(files) -> List[str]:
    """The paths ``files`` names: a glob pattern (sorted) or a list of paths, all existing."""
    if isinstance(files, (str, os.PathLike)):
        pattern = os.fspath(files)
        paths = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        if not paths:
            raise FileNotFoundError(f"no TFRecord file matches {pattern!r}")
    else:
        paths = [os.fspath(f) for f in files]
        if not paths:
            raise FileNotFoundError("no TFRecord files given (an empty list)")
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        raise FileNotFoundError(f"TFRecord file(s) not found: {missing[:5]}"
                                + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    return paths


def _record_lengths(path: str) -> np.ndarray:
    """Every record's data length in bytes, by one CRC-checked sequential read of ``path``."""
    lengths = []
    ds = tf.data.TFRecordDataset(path).map(tf.strings.length).batch(4096)
    try:
        for chunk in ds.as_numpy_iterator():
            lengths.append(chunk)
    except (tf.errors.DataLossError, tf.errors.OutOfRangeError) as err:
        good = 0  # the rare path: find the bad record's number, one record at a time
        try:
            for _ in tf.data.TFRecordDataset(path).map(tf.strings.length).as_numpy_iterator():
                good += 1
        except (tf.errors.DataLossError, tf.errors.OutOfRangeError):
            pass
        raise ValueError(f"TFRecord file {path!r}: record {good} (0-based) is corrupt or "
                         f"truncated (or the file is compressed: only uncompressed files can be "
                         f"read by offset): {err.message}") from None
    return np.concatenate(lengths).astype(np.int64) if lengths else np.zeros(0, np.int64)


def _file_key(path: str) -> Tuple[int, int]:
    stat = os.stat(path)
    return stat.st_size, stat.st_mtime_ns


def _index_path(path: str, index_dir: Optional[str]) -> str:
    folder = os.path.dirname(os.path.abspath(path)) if index_dir is None else os.fspath(index_dir)
    name = os.path.basename(path) if index_dir is None else os.path.abspath(path).replace(os.sep, "_")
    return os.path.join(folder, "." + name.lstrip("_.") + INDEX_SUFFIX)


def file_offsets(path: str, index_dir: Optional[str] = None) -> Tuple[np.ndarray, np.ndarray]:
    """``(offsets, lengths)`` of every record's data in ``path`` (bytes), cached.

    A cache whose recorded size or modification time differs from the file's is rebuilt; a
    cache that cannot be written is skipped (the index is then rebuilt in the next process).
    """
    size, mtime_ns = _file_key(path)
    cache = _index_path(path, index_dir)
    try:
        with np.load(cache) as saved:
            if (int(saved["format"]), int(saved["size"]), int(saved["mtime_ns"])) == \
                    (INDEX_FORMAT, size, mtime_ns):
                return saved["offsets"], saved["lengths"]
    except (OSError, KeyError, ValueError):
        pass  # no cache, or one from another version of the file: rebuild
    lengths = _record_lengths(path)
    starts = np.concatenate([[0], np.cumsum(lengths + HEADER_BYTES + FOOTER_BYTES)])
    if starts[-1] != size:
        raise ValueError(f"TFRecord file {path!r}: {size - starts[-1]} bytes after the last "
                         f"record ({len(lengths)} records): not a TFRecord file, or compressed "
                         f"(compressed files cannot be read by offset; write them uncompressed)")
    offsets = starts[:-1] + HEADER_BYTES
    if index_dir is not None:
        os.makedirs(index_dir, exist_ok=True)
    partial = f"{cache}.{os.getpid()}.tmp.npz"  # ranks building the same index side by side
    try:
        np.savez(partial, format=INDEX_FORMAT, size=size, mtime_ns=mtime_ns, offsets=offsets,
                 lengths=lengths)
        os.replace(partial, cache)
    except OSError as err:
        log.debug("record index of %s not cached at %s: %s", path, cache, err)
    return offsets, lengths


@dataclasses.dataclass
class RecordIndex:
    """Where each record is: ``files[file_ids[k]]``, data at byte ``offsets[k]``, ``lengths[k]`` bytes.

    Record ``k`` is the ``k``-th record of the files taken in order (within a file, the
    records ``skip`` to ``skip + take`` of each selection). ``bytes_read`` and
    ``records_read`` count what this process has read (for read-amplification reports).
    """

    files: List[str]
    file_ids: np.ndarray
    offsets: np.ndarray
    lengths: np.ndarray
    file_keys: List[Tuple[int, int]]  # (size, mtime_ns) of each file when it was indexed
    bytes_read: int = 0
    records_read: int = 0

    @classmethod
    def build(cls, files: Sequence[str], index_dir: Optional[str] = None,
              selections: Optional[Sequence[Tuple[int, Optional[int]]]] = None) -> "RecordIndex":
        """The index of ``files``; ``selections[f] = (skip, take)`` keeps a slice of file ``f``
        (``take=None``: to its end)."""
        ids, offsets, lengths, keys = [], [], [], []
        for f, path in enumerate(files):
            keys.append(_file_key(path))
            off, length = file_offsets(path, index_dir)
            skip, take = selections[f] if selections is not None else (0, None)
            end = len(off) if take is None else skip + take
            if end > len(off):
                raise ValueError(f"TFRecord file {path!r} has {len(off)} records; records "
                                 f"{skip}..{end - 1} were asked for")
            ids.append(np.full(end - skip, f, np.int32))
            offsets.append(off[skip:end])
            lengths.append(length[skip:end])
        return cls(list(files), np.concatenate(ids), np.concatenate(offsets), np.concatenate(lengths),
                   keys)

    def __len__(self) -> int:
        return len(self.offsets)

    def __post_init__(self):
        self._fds: Dict[int, int] = {}
        self._lock = threading.Lock()

    def _fd(self, file_id: int) -> int:
        fd = self._fds.get(file_id)
        if fd is None:
            with self._lock:
                fd = self._fds.get(file_id)
                if fd is None:
                    fd = os.open(self.files[file_id], os.O_RDONLY)
                    stat = os.fstat(fd)
                    if (stat.st_size, stat.st_mtime_ns) != self.file_keys[file_id]:
                        os.close(fd)  # its offsets may point anywhere now: refuse, never misread
                        raise ValueError(f"TFRecord file {self.files[file_id]!r} changed since it "
                                         f"was indexed (size, mtime_ns now {stat.st_size}, "
                                         f"{stat.st_mtime_ns}; then {self.file_keys[file_id]})")
                    self._fds[file_id] = fd
        return fd  # one descriptor a file, shared: os.pread has no file position to race on

    def read(self, key) -> bytes:
        """Record ``key``'s data, by one positioned read."""
        k = int(key)
        length = int(self.lengths[k])
        data = os.pread(self._fd(int(self.file_ids[k])), length, int(self.offsets[k]))
        if len(data) != length:
            raise ValueError(f"TFRecord file {self.files[self.file_ids[k]]!r} changed since it "
                             f"was indexed: record at byte {self.offsets[k]} is cut short")
        with self._lock:  # tf.data's map reads from several threads
            self.bytes_read += length + HEADER_BYTES + FOOTER_BYTES
            self.records_read += 1
        return data

    def read_op(self, key: tf.Tensor) -> tf.Tensor:
        """``read`` as a TF op: a scalar ``tf.string``."""
        record = tf.numpy_function(self.read, [key], tf.string)
        record.set_shape([])
        return record

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 (interpreter shutdown)
            pass


def _check_parse(parse_fn: Callable[..., Any], index: RecordIndex, what: str) -> None:
    """Runs ``parse_fn`` on the first record, so a failing one stops every rank at the start."""
    try:
        parse_fn(tf.constant(index.read(0)))
    except Exception as err:  # noqa: BLE001 (named and re-raised)
        raise ValueError(f"{what} failed on the first record of {index.files[index.file_ids[0]]!r}:"
                         f" {type(err).__name__}: {err}") from err


def _record_data(cls, index: RecordIndex, parse_fn, what: str, **kwargs):
    _check_parse(parse_fn, index, what)
    data = cls(np.arange(len(index), dtype=np.int64),
               load_fn=lambda key: parse_fn(index.read_op(key)), **kwargs)
    data.record_index = index
    return data


def from_tfrecords(cls, files, parse_fn, *, global_batch_size: int, seed: int = 0,
                   index_dir: Optional[str] = None, **kwargs):
    """``BalancedData.from_tfrecords``: see its docstring."""
    if kwargs.get("load_fn") is not None:
        raise ValueError("from_tfrecords takes parse_fn, not load_fn")
    index = RecordIndex.build(expand_files(files), index_dir)
    if len(index) == 0:
        raise ValueError(f"the TFRecord files {index.files[:5]} hold no records")
    return _record_data(cls, index, parse_fn, "parse_fn", global_batch_size=global_batch_size,
                        seed=seed, **kwargs)


# -- TensorFlow Datasets ----------------------------------------------------------------------
def _tfds():
    try:
        import tensorflow_datasets as tfds  # noqa: PLC0415 (optional dependency)
    except ImportError as err:
        raise ImportError("BalancedData.from_tfds needs tensorflow-datasets: "
                          "pip install tensorflow-datasets (scripts/install.sh installs it)") from err
    return tfds


def from_tfds(cls, name: str, split: str, *, global_batch_size: int,
              data_dir: Optional[str] = None, as_supervised: bool = False,
              map_fn: Optional[Callable[..., Any]] = None, index_dir: Optional[str] = None,
              **kwargs):
    """``BalancedData.from_tfds``: see its docstring."""
    tfds = _tfds()
    builder = tfds.builder(name, data_dir=data_dir)
    if not builder.is_prepared():
        raise ValueError(f"tfds data set {name!r} is not prepared in {builder.data_dir!r}: "
                         f"run `tfds build` or builder.download_and_prepare() first")
    file_format = str(getattr(builder.info.file_format, "value", builder.info.file_format))
    if "tfrecord" not in file_format:
        raise ValueError(f"tfds data set {name!r} is stored as {file_format!r}; only TFRecord "
                         f"shards can be read by offset")
    try:
        instructions = builder.info.splits[split].file_instructions
    except (KeyError, ValueError) as err:
        raise ValueError(f"tfds data set {name!r} has no split {split!r} (its splits: "
                         f"{sorted(builder.info.splits.keys())}): {err}") from None
    instructions = [i for i in instructions if i.take != 0]
    if not instructions:
        raise ValueError(f"split {split!r} of tfds data set {name!r} is empty")
    files = [os.fspath(i.filename) for i in instructions]
    # tfds's instructions name a shard relative to the data set's folder or in full.
    files = [f if os.path.isabs(f) else os.path.join(builder.data_dir, f) for f in files]
    selections = [(int(i.skip), None if i.take in (-1, None) else int(i.take)) for i in instructions]
    index = RecordIndex.build(expand_files(files), index_dir, selections)
    features = builder.info.features
    keys = builder.info.supervised_keys if as_supervised else None
    if as_supervised and not keys:
        raise ValueError(f"tfds data set {name!r} has no supervised keys; as_supervised=False")

    def parse(record):
        example = features.deserialize_example(record)
        if keys:
            example = tf.nest.map_structure(lambda k: example[k], tuple(keys))
        return example if map_fn is None else (map_fn(*example) if keys else map_fn(example))

    return _record_data(cls, index, parse, f"decoding tfds {name!r}" + (" with map_fn" if map_fn else ""),
                        global_batch_size=global_batch_size, **kwargs)


# -- an existing tf.data pipeline ---------------------------------------------------------------
class DatasetStream:
    """The elements of a ``tf.data.Dataset``, read forward in chunks, selected by position.

    Args:
        dataset: single examples with fully known shapes.
        positions: elements per epoch (``steps * B``).
        continues: the dataset is infinite: epoch ``e`` starts at element ``e * positions``
            (``dataset.skip``); else every epoch starts at the dataset's start.
        chunk: elements read at a time (one ``batch`` of the un-mapped elements).
    """

    def __init__(self, dataset: tf.data.Dataset, positions: int, continues: bool, chunk: int = 256):
        self.dataset, self.positions, self.continues, self.chunk = dataset, positions, continues, chunk
        self.batch_spec = tf.nest.map_structure(
            lambda s: tf.TensorSpec((None,) + tuple(s.shape), s.dtype), dataset.element_spec)
        self.elements_read = 0  # un-mapped elements this process has iterated (all epochs)

    def batches(self, index_batches, epoch: int):
        """The elements at each array of ``index_batches`` (ascending positions of ``epoch``)."""
        ds = self.dataset.skip(epoch * self.positions) if self.continues else self.dataset
        chunks = ds.batch(self.chunk).as_numpy_iterator()
        buf, start, length = None, 0, 0  # the chunk in hand holds positions [start, start + length)
        for index in index_batches:
            first, count = int(index[0]), len(index)
            if count > 1 and not np.array_equal(index, np.arange(first, first + count)):
                raise ValueError("a dataset stream can only serve contiguous positions")
            parts = []
            while count:
                while buf is None or first >= start + length:
                    start += length
                    try:
                        buf = next(chunks)
                    except StopIteration:
                        raise ValueError(f"the dataset ended after {start} elements in epoch "
                                         f"{epoch}; {self.positions} were expected "
                                         f"(steps_per_epoch x global_batch_size)") from None
                    length = len(tf.nest.flatten(buf)[0])
                    self.elements_read += length
                lo = first - start
                hi = min(lo + count, length)
                parts.append(tf.nest.map_structure(lambda a, lo=lo, hi=hi: a[lo:hi], buf))
                count -= hi - lo
                first += hi - lo
            yield parts[0] if len(parts) == 1 else tf.nest.map_structure(
                lambda *a: np.concatenate(a), *parts)


def _check_elements(dataset: tf.data.Dataset) -> None:
    """Refuses a batched or variable-shape element (``dataset.element_spec``), naming it."""
    for path, spec in zip(_paths(dataset.element_spec), tf.nest.flatten(dataset.element_spec)):
        shape = getattr(spec, "shape", None)
        if not isinstance(spec, tf.TensorSpec) or shape is None or shape.rank is None:
            raise ValueError(f"dataset element {path} is {spec}: only dense tensors of known "
                             f"shape can be balanced (map ragged or sparse data in map_fn)")
        if shape.rank and shape[0] is None:
            raise ValueError(f"dataset element {path} has shape {shape} with an unknown leading "
                             f"dimension: a batched dataset? BalancedData batches; pass single "
                             f"examples (dataset.unbatch())")
        if None in shape.as_list():
            raise ValueError(f"dataset element {path} has shape {shape}: every element must have "
                             f"the same shape before map_fn (decode or resize in map_fn)")


def _paths(structure) -> List[str]:
    flat = tf.nest.flatten_with_joined_string_paths(structure) if hasattr(
        tf.nest, "flatten_with_joined_string_paths") else None
    if flat:
        return [p or "(the element)" for p, _ in flat]
    return [f"#{i}" for i in range(len(tf.nest.flatten(structure)))]


def from_dataset(cls, dataset, *, global_batch_size: int, map_fn=None,
                 steps_per_epoch: Optional[int] = None, **kwargs):
    """``BalancedData.from_dataset``: see its docstring."""
    if not isinstance(dataset, tf.data.Dataset):
        raise TypeError(f"from_dataset takes a tf.data.Dataset; got {type(dataset).__name__}")
    for name in ("shuffle", "seed", "load_fn"):
        if name in kwargs:
            raise ValueError(f"from_dataset takes no {name}=: the dataset orders itself "
                             f"(shuffle it with a seed), and map_fn maps it")
    _check_elements(dataset)
    cardinality = int(dataset.cardinality())
    infinite = cardinality == int(tf.data.INFINITE_CARDINALITY)
    if steps_per_epoch is None:
        if cardinality < 0:
            raise ValueError(f"the dataset's length is {'infinite' if infinite else 'unknown'}: "
                             f"give steps_per_epoch")
        steps = cardinality // int(global_batch_size)
        if steps < 1:
            raise ValueError(f"the dataset has {cardinality} elements, fewer than one global "
                             f"batch (global_batch_size={global_batch_size})")
    else:
        steps = int(steps_per_epoch)
        if steps < 1 or steps != steps_per_epoch:
            raise ValueError(f"steps_per_epoch must be an integer >= 1; got {steps_per_epoch!r}")
        if cardinality >= 0 and steps * global_batch_size > cardinality:
            raise ValueError(f"steps_per_epoch={steps} needs {steps * global_batch_size} elements;"
                             f" the dataset has {cardinality}")
    positions = steps * int(global_batch_size)
    stream = DatasetStream(dataset, positions, continues=infinite)
    data = cls(np.arange(positions, dtype=np.int64), global_batch_size=global_batch_size,
               shuffle=False, load_fn=map_fn, _stream=stream, **kwargs)
    data.stream = stream
    return data
