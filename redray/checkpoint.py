"""Checkpoints: Orbax, sharded, asynchronous, atomic; resume with fallback; reshard on load.

A checkpoint is a folder ``<directory>/<step>`` holding the named items its owner
saves (pytrees of arrays; the Trainer's are ``model`` and ``train``, see
``redray/engine/state.py``) and ``meta``: JSON with at least the ``step`` (the Trainer
adds the position in the data, the run's config, metrics, its MLflow run id). This
module knows nothing of what the items mean: it never imports the engine.

Every host writes its own shards in parallel, in the background (``save`` returns once
the arrays are copied off the devices). Orbax writes into a temporary folder and
renames it when every host is done, so a step folder exists only once complete; old
checkpoints are deleted only after a newer one is complete. A checkpoint that cannot
be read is moved aside (renamed, never deleted) and the previous one is used; so is
one whose meta is valid JSON but not a checkpoint's (``check_meta``). A numeric
folder that holds no checkpoint (no ``meta`` in it, or a file) is not one: it is
skipped, never renamed.

Arrays are stored under their parameter paths, independent of the mesh, so a
checkpoint restores onto any mesh and any number of hosts (each host reads the
pieces its devices hold).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
import os
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np

from redray.storage import CHECKPOINTS, absolute, writable_folder

log = logging.getLogger("redray.checkpoint")

META = "meta"


@dataclasses.dataclass
class CheckpointConfig:
    """When and where checkpoints are written, and what resumes from them.

    Attributes:
      directory: where checkpoints go (an absolute path, or a URI Orbax supports such as
        ``gs://bucket/run``). ``redray.fit`` defaults it to ``<storage>/<name>/checkpoints``.
      save_every: also save every this many optimizer steps (None: only per epoch/end).
      every_epoch: save at the end of every epoch (after its evaluation).
      keep: how many of the latest checkpoints to keep (plus the best one).
      best_metric: a key of the evaluation rows (e.g. ``"eval_loss"``): the best
        checkpoint by it is kept even when older than the last ``keep``.
      best_mode: ``"min"`` or ``"max"`` for ``best_metric``.
      resume: continue from the last complete checkpoint in ``directory`` if there is one.
    """
    directory: str | None = None
    save_every: int | None = None
    every_epoch: bool = True
    keep: int = 3
    best_metric: str | None = None
    best_mode: str = "min"
    resume: bool = True

    def __post_init__(self):
        if self.save_every is not None and (not isinstance(self.save_every, int)
                                            or self.save_every < 1):
            raise ValueError(f"save_every={self.save_every!r}: give a positive number of steps "
                             "or None")
        if not isinstance(self.keep, int) or self.keep < 1:
            raise ValueError(f"keep={self.keep!r}: keep at least the latest checkpoint (keep>=1)")
        if self.best_mode not in ("min", "max"):
            raise ValueError(f"best_mode={self.best_mode!r}: use 'min' or 'max'")

    @classmethod
    def of(cls, value) -> "CheckpointConfig | None":
        """A config from what a user passed: None/False, a directory, or a config."""
        if value is None or value is False:
            return None
        if isinstance(value, (str, os.PathLike)):
            return cls(directory=os.fspath(value))
        if isinstance(value, cls):
            return value
        raise TypeError(f"checkpoint must be a directory or a redray.CheckpointConfig, got "
                        f"{type(value).__name__}")


class CheckpointMismatch(ValueError):
    """A checkpoint does not fit the model or data it is restored for."""


# ---------------------------------------------------------------- pytrees <-> storage
def _segment(key) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _is_key(x) -> bool:
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def to_storage(tree) -> dict:
    """Nested dict of arrays keyed by the tree's path names; PRNG keys as their data."""
    out: dict = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        node = out
        names = _names(path)
        for name in names[:-1]:
            node = node.setdefault(name, {})
        node[names[-1]] = jax.random.key_data(leaf) if _is_key(leaf) else leaf
    return out


# A stored array larger than this is written in chunks of at most this many bytes (Orbax's
# default is one chunk per device's shard, GBs at scale); a stacked parameter's (and its
# optimizer moments') in chunks of one layer, so that a layer is read without the others
# (``StoredArrays``, an export).
CHUNK_BYTES = 16 << 20


def save_args(tree: dict, ocp, stacked: dict | None = None) -> dict:
    """Orbax ``SaveArgs`` for each leaf of a stored tree (``to_storage``'s): a shard of
    more than ``CHUNK_BYTES`` in chunks of a layer where the leaf stacks layers
    (``stacked``: "/"-joined parameter path -> layer count; a leaf whose path ends with
    one, less the group's name and ``value``, with as many rows), else in chunks of at
    most ``CHUNK_BYTES``; Orbax's default for the others."""
    stacked = stacked or {}

    def args(path, leaf):
        shape = tuple(np.shape(leaf))
        sharding = getattr(leaf, "sharding", None)
        shard = tuple(sharding.shard_shape(shape)) if sharding is not None else shape
        itemsize = np.dtype(leaf.dtype).itemsize
        if len(shard) < 2 or math.prod(shard) * itemsize <= CHUNK_BYTES:
            return ocp.SaveArgs()
        names = [_segment(k) for k in path]
        names = names[:-1] if names[-1:] == ["value"] else names
        if any(stacked.get("/".join(names[i:])) == shape[0] for i in range(len(names))):
            row = math.prod(shard[1:]) * itemsize  # a layer a chunk, whatever its size
            return ocp.SaveArgs(chunk_byte_size=max(row, CHUNK_BYTES), shard_axes=(0,))
        return ocp.SaveArgs(chunk_byte_size=CHUNK_BYTES)

    return jax.tree_util.tree_map_with_path(args, tree)


def storage_paths(tree) -> list[str]:
    """The "/"-joined path each leaf of ``tree`` is stored under (``to_storage``), in
    leaf order."""
    return ["/".join(_names(path)) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _names(path) -> list[str]:
    """A leaf's key path as the names it is stored under (a bare leaf as ``value``)."""
    return [_segment(k) for k in path] or ["value"]


def _stored(abstract):
    """Shape and dtype of a leaf as stored (a PRNG key as its data)."""
    return jax.eval_shape(jax.random.key_data, abstract) if _is_key(abstract) else abstract


def _storage_target(tree) -> dict:
    """What Orbax restores into, from a tree of ``jax.ShapeDtypeStruct``: device arrays
    on a leaf's sharding, or host numpy arrays for a leaf without one (``np.empty``
    reserves, it does not fill); a PRNG key as its data."""
    def target(leaf):
        data = _stored(leaf)
        sharding = getattr(leaf, "sharding", None)
        if sharding is None:
            return np.empty(data.shape, data.dtype)
        return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=sharding)

    return to_storage(jax.tree.map(target, tree))


def _check_shapes(restored: dict, targets: dict, where: str) -> None:
    """Orbax restores an array at its stored shape whatever the target's: another
    model's sizes would pass silently. Raises ``CheckpointMismatch`` naming the first
    array whose shape differs."""
    got = jax.tree_util.tree_flatten_with_path(restored)[0]
    for (path, value), want in zip(got, jax.tree.leaves(targets)):
        if tuple(value.shape) != tuple(want.shape):
            segments = [_segment(k) for k in path][1:]  # without the item's name
            name = ".".join(segments[:-1] if segments[-1:] == ["value"] else segments)
            raise CheckpointMismatch(
                f"checkpoint {where} holds {name} with shape {tuple(value.shape)}, this "
                f"model's is {tuple(want.shape)}: pass the model the run trained (the same "
                "sizes), or start a new run (another name or directory, or resume=False)")


_LAYER_INDEX = re.compile(r"/\d+/")


def _flat(tree, prefix: str = "") -> dict:
    """A nested dict's leaves (arrays or Orbax's metadata) by their "/"-joined paths."""
    out = {}
    for key, value in tree.items():
        path = f"{prefix}/{key}" if prefix else str(key)
        if isinstance(value, dict) or (hasattr(value, "items") and not hasattr(value, "shape")):
            out.update(_flat(dict(value.items()), path))
        else:
            out[path] = value
    return out


def _leaf_shapes(tree) -> dict[str, tuple]:
    """The shape of each of a nested dict's leaves, by path (``_flat``)."""
    return {path: tuple(getattr(value, "shape", ())) for path, value in _flat(tree).items()}


def layer_moves(have: dict[str, tuple], want: dict[str, tuple]) -> dict | None:
    """How a checkpoint's arrays (``have``: path -> shape) become a model's (``want``)
    where one stores layers one by one and the other stacks them on a leading axis:
    path -> ``("stack", [the checkpoint's paths, layer by layer])`` for a stacked array
    of the model, ``("slice", the checkpoint's stacked path, layer)`` for one layer's;
    None where the two differ in anything else (other arrays, shapes or layer counts)."""
    moves = {}
    for w in (p for p in want if p not in have):
        parts = w.split("/")
        move = None
        for cut in range(len(parts)):  # the model stacks: the checkpoint has .../i/...
            listed = []
            while "/".join(parts[:cut] + [str(len(listed))] + parts[cut:]) in have:
                listed.append("/".join(parts[:cut] + [str(len(listed))] + parts[cut:]))
            if listed and want[w][:1] == (len(listed),) and \
                    all(have[p] == want[w][1:] for p in listed):
                move = ("stack", listed)
                break
        for k, part in enumerate(parts if move is None else ()):  # the model lists
            stacked = "/".join(parts[:k] + parts[k + 1:])
            if part.isdigit() and stacked in have and have[stacked][1:] == want[w] \
                    and have[stacked][0] > int(part):
                move = ("slice", stacked, int(part))
                break
        if move is None:
            return None
        moves[w] = move
    used = {p for m in moves.values() for p in (m[1] if m[0] == "stack" else [m[1]])}
    layers = {m[1]: have[m[1]][0] for m in moves.values() if m[0] == "slice"}
    sliced = {(m[1], m[2]) for m in moves.values() if m[0] == "slice"}
    if set(have) - set(want) - used or len(sliced) != sum(layers.values()):
        return None  # an array the model lacks, or layers it does not take
    return moves


def _nest(flat: dict) -> dict:
    out: dict = {}
    for path, value in flat.items():
        node = out
        *head, last = path.split("/")
        for name in head:
            node = node.setdefault(name, {})
        node[last] = value
    return out


def _reshaped_target(leaf, shape: tuple, spec: tuple):
    """A stored target (``_storage_target``'s leaf: host or device) of another shape,
    split as ``spec`` on the same mesh."""
    if isinstance(leaf, np.ndarray):
        return np.empty(shape, leaf.dtype)
    sharding = jax.sharding.NamedSharding(leaf.sharding.mesh, jax.sharding.PartitionSpec(*spec))
    return jax.ShapeDtypeStruct(shape, leaf.dtype, sharding=sharding)


def _spec(leaf) -> tuple:
    return () if isinstance(leaf, np.ndarray) else tuple(leaf.sharding.spec)


def _moved_target(storage: dict, moves: dict) -> dict:
    """The restore target in the checkpoint's layout, from the model's (``storage``)."""
    flat = _flat(storage)
    asked = {p: v for p, v in flat.items() if p not in moves}
    for path, move in moves.items():
        if move[0] == "stack":
            leaf = flat[path]  # one layer: the stacked target less its layer axis
            for p in move[1]:
                asked[p] = _reshaped_target(leaf, leaf.shape[1:], _spec(leaf)[1:])
        elif move[1] not in asked:  # all layers: the layer's target with a layer axis
            leaf = flat[path]
            layers = sum(1 for m in moves.values() if m[0] == "slice" and m[1] == move[1])
            asked[move[1]] = _reshaped_target(leaf, (layers, *leaf.shape),
                                              (None, *_spec(leaf)))
    return _nest(asked)


def _moved_back(restored: dict, storage: dict, moves: dict) -> dict:
    """The restored arrays in the model's layout (``storage``: its targets), each on
    its target's sharding."""
    import jax.numpy as jnp

    flat, targets = _flat(restored), _flat(storage)
    out = {p: v for p, v in flat.items() if p in targets}
    for path, move in moves.items():
        target = targets[path]
        host = isinstance(target, np.ndarray)
        if move[0] == "stack":
            parts = [flat[p] for p in move[1]]
            value = np.stack(parts) if host else jnp.stack(parts)
        else:
            value = flat[move[1]][move[2]]
        out[path] = value if host else jax.jit(lambda x: x,
                                               out_shardings=target.sharding)(value)
    return _nest(out)


def from_storage(stored: dict, like):
    """The inverse of ``to_storage``: arrays back into the structure of ``like``."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(like)
    values = []
    for path, ref in leaves:
        node = stored
        for name in [_segment(k) for k in path] or ["value"]:
            node = node[name]
        if _is_key(ref):
            # ref.dtype._impl works for abstract refs too
            node = jax.random.wrap_key_data(node, impl=ref.dtype._impl)
        values.append(node)
    return jax.tree_util.tree_unflatten(treedef, values)


# ---------------------------------------------------------------- the manager
class Checkpointer:
    """Saves and restores a Trainer's state under ``config.directory``.

    Every process creates one with the same arguments and calls the same methods in
    the same order (saves and restores are collective).

    Args:
      config: where and how often; ``config.directory`` must be set.
      items: the names of the items saved beside ``meta``.
    """

    def __init__(self, config: CheckpointConfig, items: Sequence[str]):
        import orbax.checkpoint as ocp

        if not config.directory:
            raise ValueError("CheckpointConfig.directory is not set: give the folder (an "
                             "absolute path or a URI) checkpoints are written to")
        self.config = config
        self.items = tuple(items)
        self.directory = writable_folder(config.directory, "CheckpointConfig.directory")
        _quiet_orbax()
        self._ocp = ocp
        self._pending: tuple | None = None
        self.last_saved: str | None = None  # the newest checkpoint this run completed
        self._open()

    def _open(self):
        ocp = self._ocp
        policies = [ocp.checkpoint_managers.LatestN(n=self.config.keep)]
        if self.config.best_metric:
            # BestN keeps the last n after an ascending sort: reverse it for "min".
            policies.append(ocp.checkpoint_managers.BestN(
                get_metric_fn=lambda m: m["value"], reverse=self.config.best_mode == "min",
                n=1, keep_checkpoints_without_metrics=False))
        self.manager = ocp.CheckpointManager(
            self.directory, item_names=(*self.items, META),
            options=ocp.CheckpointManagerOptions(
                enable_async_checkpointing=True, create=True,
                preservation_policy=ocp.checkpoint_managers.AnyPreservationPolicy(policies)))

    # ------------------------------------------------------------ writing
    def save(self, items: dict[str, Any], meta: dict, on_commit: Callable | None = None,
             stacked: dict | None = None) -> None:
        """Starts writing ``items`` (item name -> pytree of arrays) with ``meta`` (which
        holds the ``step``); returns when the arrays are off the devices.
        ``on_commit(step, path, meta)`` runs on every process once this checkpoint is
        complete (at a later ``save``, ``wait`` or ``close``). ``stacked``: the paths of
        arrays that stack layers -> their layer count, stored a layer a chunk
        (``save_args``)."""
        ocp = self._ocp
        self.wait()  # the previous one is complete before a new one starts
        step = int(meta["step"])
        metric = meta.get("metrics", {}).get(self.config.best_metric) \
            if self.config.best_metric else None
        stored = {name: to_storage(tree) for name, tree in items.items()}
        self.manager.save(step, args=ocp.args.Composite(
            **{name: ocp.args.StandardSave(tree, save_args=save_args(tree, ocp, stacked))
               for name, tree in stored.items()},
            **{META: ocp.args.JsonSave(_jsonable(meta))}),
            metrics=None if metric is None else {"value": float(metric)})
        self._pending = (step, meta, on_commit)

    @property
    def saving(self) -> int | None:
        """The step of the checkpoint in flight (started, not yet known complete), or
        None."""
        return None if self._pending is None else self._pending[0]

    def wait(self) -> None:
        """Blocks until the checkpoint in flight is complete; runs its ``on_commit``."""
        self.manager.wait_until_finished()
        if self._pending is not None:
            step, meta, on_commit = self._pending
            self._pending = None
            self.last_saved = self.step_path(step)
            if on_commit is not None:
                on_commit(step, self.step_path(step), meta)

    def close(self) -> None:
        self.wait()
        self.manager.close()

    # ------------------------------------------------------------ reading
    def steps(self) -> list[int]:
        """Complete checkpoints, oldest first (numeric folders without a meta are not
        checkpoints: skipped)."""
        from etils import epath

        self.manager.reload()
        return sorted(s for s in self.manager.all_steps()
                      if (epath.Path(self.step_path(s)) / META).is_dir())

    def step_path(self, step: int) -> str:
        return f"{self.directory}/{step}"

    def read_meta(self, step: int) -> dict:
        return self.manager.restore(step, args=self._ocp.args.Composite(
            **{META: self._ocp.args.JsonRestore()}))[META]

    def restore(self, step: int, targets: dict[str, Any]) -> dict[str, Any]:
        """The items of checkpoint ``step`` named in ``targets``: item name -> a tree of
        ``jax.ShapeDtypeStruct`` to restore into (with a sharding: onto the devices,
        resharded if the checkpoint was written on another mesh; without one: into host
        numpy arrays). PRNG keys come back as keys. Layers stored one by one
        (``layers/0/...``) restore into a model that stacks them (``scan=True``), and
        stacked layers into one that lists them (``layer_moves``)."""
        ocp = self._ocp
        moves = self.check_structure(step, targets)
        storage = {name: _storage_target(tree) for name, tree in targets.items()}
        asked = {name: _moved_target(storage[name], moves[name]) if name in moves
                 else storage[name] for name in targets}
        restored = self.manager.restore(step, args=ocp.args.Composite(
            **{name: ocp.args.StandardRestore(asked[name]) for name in targets}))
        out = {name: from_storage(_moved_back(restored[name], storage[name], moves[name])
                                  if name in moves else restored[name], tree)
               for name, tree in targets.items()}
        _check_shapes(out, targets, self.step_path(step))
        return out

    def check_structure(self, step: int, targets: dict[str, Any]) -> dict[str, dict]:
        """A checkpoint whose arrays are other paths than the model's is not damaged: it
        belongs to another model. Refuse it, naming the difference (read from the
        checkpoint's metadata; an unreadable metadata is left to the restore to report).
        Returns, for each item whose layers are laid out the other way (listed against
        stacked), how its arrays become the model's (``layer_moves``)."""
        from etils import epath

        moves = {}
        for name, tree in targets.items():
            try:
                meta = self._ocp.StandardCheckpointHandler().metadata(
                    epath.Path(self.step_path(step)) / name)
            except Exception:  # noqa: BLE001 - damage: the restore reports it
                continue
            have = _leaf_shapes(meta)
            want = _leaf_shapes(to_storage(jax.tree.map(_stored, tree)))
            if not have or set(have) == set(want):
                continue
            found = layer_moves(have, want)
            if found is not None:
                moves[name] = found
                continue
            missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
            hint = ""
            if any(_LAYER_INDEX.search(p) for p in extra) != any(_LAYER_INDEX.search(p)
                                                                  for p in missing):
                hint = (" Its layers are stored one by one (layers/0/...) and the model "
                        "stacks them, or the other way round, and their shapes or count "
                        "differ from the model's.")
            raise CheckpointMismatch(
                f"the checkpoint {self.step_path(step)} holds other arrays than this model "
                f"in {name!r}: {len(missing)} of the model's are not in it (e.g. "
                f"{missing[:3]}), {len(extra)} of its are not in the model (e.g. "
                f"{extra[:3]}).{hint} Restore it into the model that wrote it, or start a "
                "new run (another name or directory, or resume=False)")
        return moves

    def restore_latest(self, targets: dict[str, Any],
                       check: Callable[[dict], None] | None = None,
                       required: dict[str, type] | None = None):
        """(items, meta) of the newest checkpoint that reads back, or None if none.

        ``targets``: as for ``restore``, e.g. the state's shapes with the current
        mesh's shardings (a checkpoint written on another mesh is resharded here).
        ``check(meta)`` may raise ``CheckpointMismatch`` to refuse a checkpoint for
        this run (e.g. other data): that error reaches the caller as is.
        ``required``: meta keys (beyond ``step``) and their types the caller reads.
        An unreadable checkpoint (truncated, half-deleted, a meta without ``required``)
        is moved aside with a warning and the one before it is tried.
        """
        for step in reversed(self.steps()):
            error = None
            try:
                meta = self.read_meta(step)
                check_meta(meta, step, required)
                if check is not None:
                    check(meta)
                items = self.restore(step, targets)
            except CheckpointMismatch:
                raise
            except Exception as e:  # noqa: BLE001 - any read failure means: not usable
                error, items = e, None
            if _all_processes_ok(error is None):
                return items, meta
            self._set_aside(step, error)
        return None

    def _set_aside(self, step: int, error: Exception | None) -> None:
        from etils import epath

        path = epath.Path(self.step_path(step))
        aside = epath.Path(f"{self.step_path(step)}.unreadable-{int(time.time())}")
        reason = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}" \
            if error is not None else "another host could not read it"
        log.warning("checkpoint %s cannot be restored (%s); it is moved to %s and the "
                    "previous checkpoint is used", path, reason, aside)
        if jax.process_index() == 0 and path.exists():
            path.rename(aside)
        _barrier(f"redray_set_aside_{step}")
        self.manager.close()
        self._open()


class StoredArrays:
    """The arrays of one item of one checkpoint, read a piece at a time without
    restoring the item: ``read(path, index)`` opens the array stored under ``path`` (a
    "/"-joined path of ``shapes``) with TensorStore and reads ``array[index]`` (a layer
    of a stacked parameter), cast to the dtype asked while it is read. A checkpoint
    saved in chunks along the leading axis (``save_args``) gives a layer by reading its
    chunks alone; an older one reads the chunk (the shard) that holds it.

    Raises:
      FileNotFoundError: ``folder`` holds no such item.
    """

    def __init__(self, step_path: str, item: str):
        import orbax.checkpoint as ocp
        from etils import epath

        _quiet_orbax()
        self.folder = epath.Path(step_path) / item
        if not (self.folder / "_METADATA").exists():
            raise FileNotFoundError(f"no {item!r} arrays in the checkpoint {step_path}")
        with (self.folder / "_METADATA").open() as f:
            stored = json.load(f)
        self._zarr3, self._ocdbt = stored.get("use_zarr3", False), stored.get("use_ocdbt", True)
        self.shapes = _leaf_shapes(ocp.StandardCheckpointHandler().metadata(self.folder))
        self._ocp = ocp
        self._context = ocp.type_handlers.get_ts_context(use_ocdbt=self._ocdbt)
        self._arrays: dict = {}

    def read(self, path: str, index: int | None = None, dtype=None) -> np.ndarray:
        """``array[index]`` (the whole array for None) of the array stored under
        ``path``, as a host array of ``dtype`` (default: as stored)."""
        import tensorstore as ts

        if path not in self.shapes:
            raise KeyError(f"the checkpoint {self.folder} stores no array {path!r}")
        array = self._arrays.get(path)
        if array is None:
            info = self._ocp.type_handlers.ParamInfo(
                name=path.replace("/", "."), parent_dir=self.folder, use_zarr3=self._zarr3,
                ts_context=self._context)
            spec = self._ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=self._ocdbt)
            array = ts.open(spec, context=self._context, open=True, read=True).result()
            self._arrays[path] = array
        grid = tuple(array.chunk_layout.read_chunk.shape or array.shape)
        if dtype is not None and np.dtype(dtype) != np.dtype(array.dtype.numpy_dtype):
            array = ts.cast(array, ts.dtype(np.dtype(dtype).name))
        piece, grid = (array, grid) if index is None else (array[index], grid[1:])
        shape = tuple(piece.shape)
        counts = [-(-n // max(c, 1)) for n, c in zip(shape, grid)]
        if math.prod(counts) <= 1:
            return np.asarray(piece.read().result())
        # a chunk at a time into the result: the chunks' stored bytes are not all
        # decoded at once (TensorStore would hold every one in the stored dtype)
        out = np.empty(shape, np.dtype(dtype) if dtype is not None else
                       np.dtype(array.dtype.numpy_dtype))
        origin = piece.domain.origin
        for at in np.ndindex(*counts):
            box = tuple(slice(i * c, min((i + 1) * c, n)) for i, c, n in zip(at, grid, shape))
            moved = tuple(slice(o + b.start, o + b.stop) for o, b in zip(origin, box))
            out[box] = piece[moved].read().result()
        return out


def _quiet_orbax() -> None:
    """Orbax reports every save step at INFO through absl; keep warnings only, unless
    the user configured absl logging themselves."""
    absl = logging.getLogger("absl")
    if absl.level == logging.NOTSET:
        absl.setLevel(logging.WARNING)


def _all_processes_ok(ok: bool) -> bool:
    if jax.process_count() == 1:
        return ok
    from jax.experimental import multihost_utils

    return bool(np.all(multihost_utils.process_allgather(np.array(ok, np.int32))))


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def _jsonable(value):
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (np.generic,)):
        return value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


class MalformedMeta(ValueError):
    """A checkpoint's meta is valid JSON but not what its owner wrote."""


def check_meta(meta: Any, step: int, required: dict[str, type] | None = None) -> None:
    """Raises ``MalformedMeta`` unless ``meta`` is a dict whose ``step`` is ``step`` and
    whose ``required`` keys have their types (``int`` never accepts a bool); an
    optional ``run``/``metrics``/``config`` must be a dict."""
    if not isinstance(meta, dict):
        raise MalformedMeta(f"its meta is a {type(meta).__name__}, not an object")
    for key, kind in {"step": int, **(required or {})}.items():
        value = meta.get(key)
        if key not in meta:
            raise MalformedMeta(f"its meta has no {key!r}")
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise MalformedMeta(f"its meta's {key!r} is {value!r}, not of type {kind.__name__}")
    if meta["step"] != step:
        raise MalformedMeta(f"its meta says step {meta['step']}, its folder {step}")
    for key in ("run", "metrics", "config"):
        if key in meta and not isinstance(meta[key], dict):
            raise MalformedMeta(f"its meta's {key!r} is {meta[key]!r}, not an object")


def _step_metas(directory: str):
    """(step, meta) of the complete checkpoints in ``directory``, newest first, read as
    plain JSON (no Orbax, no devices); unreadable or malformed metas are skipped."""
    import json

    from etils import epath

    root = epath.Path(absolute(directory))
    if not root.is_dir():
        return
    for step in sorted((int(p.name) for p in root.iterdir() if p.name.isdigit()), reverse=True):
        try:
            meta = json.loads((root / str(step) / META / "metadata").read_text())
            check_meta(meta, step)
        except (OSError, ValueError):
            continue
        yield step, meta


def latest_meta(directory: str) -> dict | None:
    """The meta of the newest complete checkpoint in ``directory`` (for a driver that
    only needs, e.g., the run's MLflow id)."""
    return next((meta for _, meta in _step_metas(directory)), None)


def best_checkpoint(directory: str, metric: str, mode: str) -> dict | None:
    """``{"metric", "value", "step"}`` of the checkpoint with the min/max ``metric``, or
    None when no checkpoint in ``directory`` has it."""
    scored = [(meta.get("metrics", {}).get(metric), step)
              for step, meta in _step_metas(directory)]
    scored = [(v, s) for v, s in scored if isinstance(v, (int, float))]
    if not scored:
        return None
    value, step = (min if mode == "min" else max)(scored)
    return {"metric": metric, "value": value, "step": step}


# ---------------------------------------------------------------- choosing a checkpoint
def find_checkpoints(path: str) -> tuple[str, int | None]:
    """(checkpoints folder, step or None) for a run folder, a checkpoints folder or
    one checkpoint's folder."""
    from etils import epath

    path = absolute(path)
    p = epath.Path(path)
    if (p / CHECKPOINTS).is_dir():
        return f"{path}/{CHECKPOINTS}", None
    if p.name.isdigit() and (p / META).exists():
        return str(p.parent), int(p.name)
    if p.is_dir():
        return path, None
    raise FileNotFoundError(f"no checkpoints at {path}: give a run folder "
                            "(<storage>/<name>), its checkpoints folder, or one checkpoint")


def select_step(checkpointer: Checkpointer, step: int | None, best: str | None) -> int:
    """The checkpoint to read: ``step`` if given, else the best by ``best``
    (``"min:<metric>"``/``"max:<metric>"``) if given, else the newest."""
    steps = checkpointer.steps()
    if not steps:
        raise FileNotFoundError(f"no complete checkpoint in {checkpointer.directory}")
    if step is not None:
        if step not in steps:
            raise FileNotFoundError(f"no checkpoint of step {step} in {checkpointer.directory}; "
                                    f"there are steps {steps}")
        return step
    if best is None:
        return steps[-1]
    mode, _, metric = best.partition(":")
    if mode not in ("min", "max") or not metric:
        raise ValueError(f"best={best!r}: write 'min:<metric>' or 'max:<metric>', "
                         "e.g. 'min:eval_loss'")
    found = best_checkpoint(checkpointer.directory, metric, mode)
    if found is None:
        raise FileNotFoundError(f"no checkpoint in {checkpointer.directory} has the metric "
                                f"{metric!r}")
    return found["step"]
