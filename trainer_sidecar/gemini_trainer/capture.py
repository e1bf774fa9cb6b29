"""What a rank must keep to continue bit-exactly, and how to put it back.

A *state tree* is nested dicts/lists/tuples of plain values whose leaves may be tensors.
``capture`` returns references to the live tensors (no copies: the checkpointer copies them
straight into shared memory); ``load`` receives tensors that are views of shared memory and
copies them into the live ones.

- DeepSpeed ZeRO-3 (``DeepSpeedZero3State``): the rank's fp32 partitioned flat groups
  (``fp32_partitioned_groups_flat``), the Adam state of those tensors, the optimizer
  ``param_groups`` (lr, betas, ...), the loss scaler, the engine's step counters and the LR
  scheduler. On load the partitioned (bit16) parameters are re-partitioned from the master
  weights, as DeepSpeed's own ``_rigid_load_state_dict`` does; without that, and without the
  ``param_groups``, the continuation is not bit-exact. The optimizer may be offloaded to CPU.
- DeepSpeed ZeRO-1 and ZeRO-2 (``DeepSpeedZero12State``): the same, with the rank's fp32
  partition of each parameter group (``single_partition_of_fp32_groups``); on load each rank
  refreshes its slice of the (whole, bit16) model weights from them and all-gathers the rest,
  as DeepSpeed's step does (``update_lp_params``).
- Plain PyTorch, DDP and FSDP2 (``TorchState``): ``torch.distributed.checkpoint.state_dict``
  ``get_state_dict``/``set_state_dict`` with this rank's local shards (DTensors are kept as
  their local tensor), plus the LR scheduler.
- Both add the RNG states (python ``random``, numpy, torch CPU and CUDA when present).

The tree is stored as a JSON index plus raw tensor bytes (``encode_tree``/``decode_tree``):
no pickling, floats exact (JSON keeps the shortest repr that round-trips).
"""

from __future__ import annotations

import base64
import random
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import numpy as np
import torch

Tree = Any


class StateAdapter(Protocol):
    """Captures and restores one training framework's state as a tree of tensors."""

    kind: str

    def capture(self) -> Tree: ...

    def load(self, tree: Tree) -> None: ...


# -- tree codec --------------------------------------------------------------------------------


def encode_tree(tree: Tree) -> tuple[Tree, list[torch.Tensor]]:
    """Split a state tree into a JSON-able skeleton and the list of its tensors (by reference)."""
    tensors: list[torch.Tensor] = []
    return _encode(tree, tensors, "state"), tensors


def _encode(obj: Any, tensors: list[torch.Tensor], path: str) -> Any:
    if obj is None or isinstance(obj, bool | int | str):
        return obj
    if isinstance(obj, float):
        return obj
    if isinstance(obj, torch.Tensor):
        local = obj.to_local() if hasattr(obj, "to_local") else obj  # DTensor: this rank's shard
        tensors.append(local.detach())
        return {"__tensor__": len(tensors) - 1}
    if isinstance(obj, np.ndarray):
        tensors.append(torch.from_numpy(np.ascontiguousarray(obj)))
        return {"__ndarray__": len(tensors) - 1}
    if isinstance(obj, np.generic):
        return _encode(obj.item(), tensors, path)
    if isinstance(obj, list):
        return [_encode(v, tensors, f"{path}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v, tensors, f"{path}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: _encode(v, tensors, f"{path}.{k}") for k, v in obj.items()}
        return {
            "__dict__": [
                [_encode(k, tensors, path), _encode(v, tensors, f"{path}[{k!r}]")]
                for k, v in obj.items()
            ]
        }
    if isinstance(obj, bytes):
        return {"__bytes__": base64.b64encode(obj).decode()}
    if isinstance(obj, torch.dtype):
        return {"__dtype__": str(obj).removeprefix("torch.")}
    raise TypeError(
        f"cannot checkpoint {path} of type {type(obj).__name__}: state must be made of "
        "None, bool, int, float, str, bytes, lists, tuples, dicts, tensors or numpy arrays"
    )


def decode_tree(skeleton: Tree, tensors: list[torch.Tensor]) -> Tree:
    """Rebuild a tree from its skeleton and tensors (decoded tensors are not copied)."""
    if isinstance(skeleton, list):
        return [decode_tree(v, tensors) for v in skeleton]
    if not isinstance(skeleton, dict):
        return skeleton
    if "__tensor__" in skeleton:
        return tensors[skeleton["__tensor__"]]
    if "__ndarray__" in skeleton:
        return tensors[skeleton["__ndarray__"]].numpy()
    if "__tuple__" in skeleton:
        return tuple(decode_tree(v, tensors) for v in skeleton["__tuple__"])
    if "__dict__" in skeleton:
        return {decode_tree(k, tensors): decode_tree(v, tensors) for k, v in skeleton["__dict__"]}
    if "__bytes__" in skeleton:
        return base64.b64decode(skeleton["__bytes__"])
    if "__dtype__" in skeleton:
        return getattr(torch, skeleton["__dtype__"])
    return {k: decode_tree(v, tensors) for k, v in skeleton.items()}


def dtype_label(t: torch.Tensor) -> str:
    return str(t.dtype)


def torch_dtype(label: str) -> torch.dtype:
    dtype = getattr(torch, label.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {label!r} in a checkpoint")
    return dtype


@contextmanager
def _quiet_readonly() -> Iterator[None]:
    # Views of a read-only mapping: torch warns that they are not writable. They are only
    # ever copied from, never written.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        yield


def tensor_view(raw: np.ndarray, label: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor over the raw bytes of a payload entry (no copy)."""
    with _quiet_readonly():
        flat = torch.from_numpy(raw)
    return flat.view(torch_dtype(label)).view(shape)


def copy_into(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    """Copy a saved tensor into a live one, refusing silent reshapes or casts."""
    local = dst.to_local() if hasattr(dst, "to_local") else dst
    if local.shape != src.shape or local.dtype != src.dtype:
        raise ValueError(
            f"checkpoint does not fit {what}: saved {tuple(src.shape)} {src.dtype}, live "
            f"{tuple(local.shape)} {local.dtype}; restore with the same model, world size "
            "and configuration that wrote it"
        )
    with torch.no_grad():
        local.copy_(src)


def owned(tree: Tree) -> Tree:
    """A deep copy in which every tensor owns its memory (no view of shared memory left)."""
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    if isinstance(tree, np.ndarray):
        return tree.copy()
    if isinstance(tree, list):
        return [owned(v) for v in tree]
    if isinstance(tree, tuple):
        return tuple(owned(v) for v in tree)
    if isinstance(tree, dict):
        return {k: owned(v) for k, v in tree.items()}
    return tree


# -- RNG ---------------------------------------------------------------------------------------


def capture_rng() -> Tree:
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: Tree) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"].clone())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([t.clone() for t in state["cuda"]])


# -- DeepSpeed ZeRO-1, -2 and -3 ---------------------------------------------------------------

_ENGINE_COUNTERS = ("global_steps", "global_samples", "micro_steps", "skipped_steps")


class _DeepSpeedZeroState:
    """What every ZeRO stage keeps beside its fp32 master partitions: the base optimizer's state
    of those partitions and its ``param_groups``, the loss scaler, the engine's counters and the
    LR scheduler. Subclasses name the partitions and refresh the working (bit16) weights."""

    kind = "deepspeed-zero"

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.zero = engine.optimizer

    def _master_partitions(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def _refresh_working_weights(self) -> None:
        raise NotImplementedError

    def _base_state(self, flat: torch.Tensor) -> dict[str, Any]:
        state: dict[str, Any] = self.zero.optimizer.state.get(flat, {})
        return state

    def capture(self) -> Tree:
        zero = self.zero
        flats = self._master_partitions()
        return {
            "fp32_flat": flats,
            "optimizer_state": [dict(self._base_state(f)) for f in flats],
            "param_groups": [
                {k: v for k, v in g.items() if k != "params"} for g in zero.optimizer.param_groups
            ],
            "loss_scaler": _plain_attrs(zero.loss_scaler),
            "engine": {name: getattr(self.engine, name) for name in _ENGINE_COUNTERS},
            "lr_scheduler": _scheduler_state(self.engine.lr_scheduler),
        }

    def load(self, tree: Tree) -> None:
        zero = self.zero
        flats = self._master_partitions()
        if len(tree["fp32_flat"]) != len(flats):
            raise ValueError(
                f"checkpoint has {len(tree['fp32_flat'])} fp32 partitions, the engine has "
                f"{len(flats)}; restore with the same model and configuration"
            )
        for i, (live, saved) in enumerate(zip(flats, tree["fp32_flat"], strict=True)):
            copy_into(live, saved, f"fp32 partition of group {i}")
            self._load_base_state(live, tree["optimizer_state"][i], i)
        for group, saved_group in zip(
            zero.optimizer.param_groups, tree["param_groups"], strict=True
        ):
            group.update(owned(saved_group))
        for name, value in tree["loss_scaler"].items():
            setattr(zero.loss_scaler, name, value)
        for name, value in tree["engine"].items():
            setattr(self.engine, name, value)
        if tree["lr_scheduler"] is not None and self.engine.lr_scheduler is not None:
            self.engine.lr_scheduler.load_state_dict(owned(tree["lr_scheduler"]))
        self._refresh_working_weights()

    def _load_base_state(self, flat: torch.Tensor, saved: dict[str, Any], i: int) -> None:
        live = self.zero.optimizer.state.setdefault(flat, {})
        for key, value in saved.items():
            current = live.get(key)
            if isinstance(value, torch.Tensor) and isinstance(current, torch.Tensor):
                copy_into(current, value, f"optimizer state {key!r} of group {i}")
            else:
                live[key] = owned(value)


class DeepSpeedZero3State(_DeepSpeedZeroState):
    """This rank's ZeRO-3 partition of a DeepSpeed engine (see the module docstring)."""

    kind = "deepspeed-zero3"

    def __init__(self, engine: Any) -> None:
        opt = getattr(engine, "optimizer", None)
        if opt is None or not hasattr(opt, "fp32_partitioned_groups_flat"):
            raise TypeError(
                "DeepSpeedZero3State needs an engine built with zero_optimization.stage 3 and "
                f"an optimizer; got optimizer {type(opt).__name__}"
            )
        if getattr(opt, "swap_optimizer", False) or getattr(opt, "offload_param", False):
            raise TypeError(
                "ZeRO-3 with the optimizer offloaded to NVMe, or with parameter offload, is not "
                "supported (optimizer offload to CPU is)"
            )
        _refuse_partial_offload(opt)
        super().__init__(engine)

    def _master_partitions(self) -> list[torch.Tensor]:
        return list(self.zero.fp32_partitioned_groups_flat)

    def _refresh_working_weights(self) -> None:
        # As DeepSpeed's _rigid_load_state_dict: the partitioned (bit16) parameters are
        # refreshed from the restored fp32 master weights, then unflattened into the views
        # each partitioned parameter points at.
        zero = self.zero
        with torch.no_grad():
            for i, fp32 in enumerate(zero.fp32_partitioned_groups_flat):
                if fp32.numel() > 0:
                    zero.fp16_partitioned_groups_flat[i].data.copy_(fp32.data)
            for i, flat in enumerate(zero.fp16_partitioned_groups_flat):
                params = zero.fp16_partitioned_groups[i]
                for param, view in zip(params, zero.unflatten(flat, params), strict=True):
                    param.data = view.data


class DeepSpeedZero12State(_DeepSpeedZeroState):
    """This rank's ZeRO-1 or ZeRO-2 partition of a DeepSpeed engine: the fp32 master partition
    of each parameter group (``single_partition_of_fp32_groups``) and its optimizer state. The
    model's working (bit16) weights are whole on every rank; they are not stored: after a load
    each rank refreshes its partition from the master weights and all-gathers the others, as
    DeepSpeed's own step does, so restore is a collective (every rank calls it, as it does)."""

    def __init__(self, engine: Any) -> None:
        opt = getattr(engine, "optimizer", None)
        if opt is None or not hasattr(opt, "single_partition_of_fp32_groups"):
            raise TypeError(
                "DeepSpeedZero12State needs an engine built with zero_optimization.stage 1 or 2 "
                f"and an optimizer; got optimizer {type(opt).__name__}"
            )
        if getattr(opt, "zenflow", False):
            raise TypeError("ZeRO-1/2 with ZenFlow is not supported (its CPU step keeps state)")
        super().__init__(engine)
        # stage 2 partitions the gradients too; the two write different kinds, so a restore
        # with the other stage is refused with a clear message instead of loading wrong shapes
        self.kind = f"deepspeed-zero{2 if opt.partition_gradients else 1}"

    def _master_partitions(self) -> list[torch.Tensor]:
        return list(self.zero.single_partition_of_fp32_groups)

    def _refresh_working_weights(self) -> None:
        self.zero.update_lp_params()  # copy fp32 -> own bit16 partition, all-gather the rest


def _refuse_partial_offload(zero: Any) -> None:
    # With a partial offload, some sub-groups step on the device with a second optimizer
    # whose state the adapter does not read.
    if getattr(zero, "offload_optimizer", False) and getattr(zero, "partial_offload", 1.0) != 1.0:
        raise TypeError("ZeRO-3 with a partial optimizer offload (ratio < 1) is not supported")


def _plain_attrs(obj: Any) -> dict[str, Any]:
    return {k: v for k, v in vars(obj).items() if isinstance(v, bool | int | float | str)}


def _scheduler_state(scheduler: Any) -> Tree:
    return None if scheduler is None else scheduler.state_dict()


# -- plain PyTorch, DDP, FSDP2 -----------------------------------------------------------------


class TorchState:
    """Model + optimizer through torch.distributed.checkpoint's state_dict APIs (local shards)."""

    kind = "torch-dcp"

    def __init__(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, lr_scheduler: Any = None
    ) -> None:
        from torch.distributed.checkpoint import state_dict as dcp_sd

        self._dcp = dcp_sd
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self._options = dcp_sd.StateDictOptions(full_state_dict=False, cpu_offload=False)

    def _live(self) -> tuple[dict[str, Any], dict[str, Any]]:
        model_sd, optim_sd = self._dcp.get_state_dict(
            self.model, self.optimizer, options=self._options
        )
        return model_sd, optim_sd

    def capture(self) -> Tree:
        model_sd, optim_sd = self._live()
        return {
            "model": model_sd,
            "optimizer": optim_sd,
            "lr_scheduler": _scheduler_state(self.lr_scheduler),
        }

    def load(self, tree: Tree) -> None:
        # get_state_dict returns the live tensors (creating the optimizer state if needed);
        # the saved bytes are copied into them, then set_state_dict applies the rest.
        model_sd, optim_sd = self._live()
        model_sd = _merge_into(model_sd, tree["model"], "model")
        optim_sd = _merge_into(optim_sd, tree["optimizer"], "optimizer")
        self._dcp.set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=model_sd,
            optim_state_dict=optim_sd,
            options=self._options,
        )
        if tree["lr_scheduler"] is not None and self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(owned(tree["lr_scheduler"]))


def _merge_into(live: Any, saved: Any, path: str) -> Any:
    """Copy saved tensors into the live ones; everything else comes from ``saved``."""
    if isinstance(saved, torch.Tensor):
        if isinstance(live, torch.Tensor):
            copy_into(live, saved, path)
            return live
        return saved.clone()
    if isinstance(saved, dict):
        base = live if isinstance(live, dict) else {}
        return {k: _merge_into(base.get(k), v, f"{path}.{k}") for k, v in saved.items()}
    if isinstance(saved, list | tuple):
        base_seq = live if isinstance(live, list | tuple) and len(live) == len(saved) else None
        items = [
            _merge_into(base_seq[i] if base_seq is not None else None, v, f"{path}[{i}]")
            for i, v in enumerate(saved)
        ]
        return items if isinstance(saved, list) else tuple(items)
    return saved


# -- selection ---------------------------------------------------------------------------------


def adapter_for(target: Any, optimizer: Any = None, lr_scheduler: Any = None) -> StateAdapter:
    """The adapter for a DeepSpeed engine (by its ZeRO stage), or a (model, optimizer) pair."""
    zero = getattr(target, "optimizer", None)
    if hasattr(zero, "fp32_partitioned_groups_flat"):
        return DeepSpeedZero3State(target)
    if hasattr(zero, "single_partition_of_fp32_groups"):
        return DeepSpeedZero12State(target)
    if isinstance(target, torch.nn.Module) and isinstance(optimizer, torch.optim.Optimizer):
        return TorchState(target, _inner_optimizer(optimizer), lr_scheduler)
    raise TypeError(
        "Checkpointer needs a DeepSpeed engine with ZeRO stage 1, 2 or 3, or a torch.nn.Module "
        f"with its torch.optim.Optimizer; got {type(target).__name__} and "
        f"{type(optimizer).__name__}"
    )


def _inner_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that holds the state: Accelerate's AcceleratedOptimizer wraps one, and its
    own step() (gradient sync and scaler checks) is not for the state-initialising step that
    torch.distributed.checkpoint takes."""
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer
