"""LoRA adapters on the CPU engine, in TensorRT-LLM's request tensors.

A request names its adapter with `lora_task_id`; the first request of a task also carries the adapter itself as
`lora_weights` [rows, width] and `lora_config` [rows, 3] (module id, layer, rank), one row per module and layer,
each weight row A ([rank, in], flattened) then B ([out, rank], flattened, the PEFT scale alpha/rank folded in),
zero-padded to the width. That is TensorRT-LLM's layout (runtime/loraModule.h module ids, loraUtils.cpp checks), so
the frontend sends both engines the same tensors. The engine keeps adapters in a LoraCache with a byte budget,
evicting the least recently used; a request for a task it does not hold fails with TensorRT-LLM's own error text,
on which the frontend sends the weights again.

A step with adapters adds each adapter's low-rank product to its own requests' rows only (LoraBatch): the base
projection runs once for the whole batch as before (a base row gets exactly its old bits), and each adapter's rows
are gathered, multiplied by its A and B, and added back. No merged copy of the weights is made per adapter.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from cpu_engine.types import RequestError

# TensorRT-LLM's LoraModule::ModuleType ids of the Llama projections (upstream maps gate_proj to mlp_h_to_4h and
# up_proj to mlp_gate).
MODULE_IDS = {"q_proj": 1, "k_proj": 2, "v_proj": 3, "o_proj": 4, "gate_proj": 5, "down_proj": 6, "up_proj": 7}
MODULE_NAMES = {module_id: name for name, module_id in MODULE_IDS.items()}
# Where each module's output lands in the engine's fused projections (q/k/v fused, gate/up fused).
FUSED = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "o_proj": "o_proj", "gate_proj": "gate_up",
         "up_proj": "gate_up", "down_proj": "down"}


def not_in_cache(task_id: int) -> str:
    """TensorRT-LLM's error for a task id sent without weights that its LoRA cache does not hold (the frontend
    matches it to send the weights again)."""
    return f"LoRA task {task_id} not found in cache. Please send LoRA weights with request"


@dataclass(frozen=True)
class ModelShapes:
    """What an adapter must fit: each module's (in, out) features and where its output starts in its fused
    projection."""

    num_layers: int
    dims: dict[str, tuple[int, int]]
    offsets: dict[str, int]

    @classmethod
    def of(cls, hidden: int, intermediate: int, q_size: int, kv_size: int, num_layers: int) -> "ModelShapes":
        dims = {"q_proj": (hidden, q_size), "k_proj": (hidden, kv_size), "v_proj": (hidden, kv_size),
                "o_proj": (q_size, hidden), "gate_proj": (hidden, intermediate), "up_proj": (hidden, intermediate),
                "down_proj": (intermediate, hidden)}
        offsets = {"q_proj": 0, "k_proj": q_size, "v_proj": q_size + kv_size, "o_proj": 0, "gate_proj": 0,
                   "up_proj": intermediate, "down_proj": 0}
        return cls(num_layers, dims, offsets)


@dataclass(eq=False)
class LoraAdapter:
    """One adapter: for each layer, for each fused projection, the (A [r, in], B [out, r], output offset) of its
    modules. `key` salts its prompts' prefix-cache keys: K/V through an adapter are not the base model's."""

    task_id: int
    rank: int
    layers: list[dict[str, list[tuple[torch.Tensor, torch.Tensor, int]]]]
    nbytes: int
    key: bytes = field(default=b"")
    # Per layer and fused projection: (A of every module stacked [sum of ranks, in], B of every module laid out
    # block-diagonally [lo:hi columns of the projection's output, sum of ranks], lo, hi): a projection's whole
    # adapter is two products, whatever modules it targets (q, k and v together; gate and up together).
    stacked: list[dict[str, tuple[torch.Tensor, torch.Tensor, int, int]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.key = b"lora:%d" % self.task_id
        self.nbytes = 0
        for modules in self.layers:
            stacked = {}
            for projection, parts in modules.items():
                a_all = torch.cat([a for a, _, _ in parts]).contiguous()
                lo = min(offset for _, _, offset in parts)
                hi = max(offset + b.shape[0] for _, b, offset in parts)
                b_all = torch.zeros(hi - lo, a_all.shape[0])
                start = 0
                for a, b, offset in parts:
                    b_all[offset - lo:offset - lo + b.shape[0], start:start + a.shape[0]] = b
                    start += a.shape[0]
                stacked[projection] = (a_all, b_all, lo, hi)
                self.nbytes += a_all.nbytes + b_all.nbytes
            self.stacked.append(stacked)
        self.layers = []  # the stacked copies replace them

def adapter_from_tensors(task_id: int, weights: np.ndarray, config: np.ndarray, shapes: ModelShapes,
                         max_rank: int) -> LoraAdapter:
    """The adapter in `lora_weights`/`lora_config`, checked against the model (RequestError on any mismatch)."""
    config = np.asarray(config)
    weights = np.asarray(weights)
    if config.ndim == 3:  # a batch dimension of 1, as the backend's [-1, -1] inputs may arrive
        config, weights = config[0], weights[0]
    if config.ndim != 2 or config.shape[1] < 3 or weights.ndim != 2 or weights.shape[0] != config.shape[0]:
        raise RequestError(f"lora_config must be [modules x layers, 3] and lora_weights [the same rows, width]; "
                           f"got {list(config.shape)} and {list(weights.shape)}")
    layers: list[dict] = [{} for _ in range(shapes.num_layers)]
    rank, nbytes = 0, 0
    for row, (module_id, layer, r) in zip(weights, config[:, :3].astype(np.int64)):
        name = MODULE_NAMES.get(int(module_id))
        if name is None:
            raise RequestError(f"lora_config: module id {module_id} is not one of the engine's "
                               f"{sorted(MODULE_NAMES)} ({', '.join(MODULE_IDS)})")
        if not 0 <= layer < shapes.num_layers:
            raise RequestError(f"lora_config: layer {layer} is outside the model's {shapes.num_layers} layers")
        if not 0 < r <= max_rank:
            raise RequestError(f"lora_config: rank {r} is outside 1..{max_rank} (the engine's max_lora_rank)")
        d_in, d_out = shapes.dims[name]
        if r * (d_in + d_out) > row.shape[0]:
            raise RequestError(f"lora_weights: a row of {row.shape[0]} values cannot hold {name} of rank {r} "
                               f"({d_in} in, {d_out} out) for this model")
        a = torch.from_numpy(np.ascontiguousarray(row[:r * d_in], dtype=np.float32)).view(r, d_in)
        b = torch.from_numpy(np.ascontiguousarray(row[r * d_in:r * (d_in + d_out)], dtype=np.float32)).view(d_out, r)
        layers[int(layer)].setdefault(FUSED[name], []).append((a, b, shapes.offsets[name]))
        rank, nbytes = max(rank, int(r)), nbytes + a.nbytes + b.nbytes
    if not nbytes:
        raise RequestError("lora_config holds no module")
    return LoraAdapter(task_id, rank, layers, nbytes)


class LoraCache:
    """Adapters by task id within `budget_bytes`, least recently used evicted first (TensorRT-LLM's PEFT cache
    evicts too). A running request holds its adapter itself, so evicting one only makes the next request of its
    task send the weights again. Thread-safe: requests resolve their adapter on Triton's thread."""

    def __init__(self, shapes: ModelShapes, budget_bytes: int, max_rank: int):
        self.shapes, self.budget_bytes, self.max_rank = shapes, budget_bytes, max_rank
        self._adapters: OrderedDict[int, LoraAdapter] = OrderedDict()
        self._lock = threading.Lock()

    def resolve(self, task_id: int, weights: np.ndarray | None, config: np.ndarray | None) -> LoraAdapter:
        """The task's adapter: parsed and cached from `weights`/`config` when sent, else from the cache."""
        if (weights is None) != (config is None):
            raise RequestError("lora_weights and lora_config go together")
        if weights is None:
            with self._lock:
                adapter = self._adapters.get(task_id)
                if adapter is None:
                    raise RequestError(not_in_cache(task_id))
                self._adapters.move_to_end(task_id)
                return adapter
        adapter = adapter_from_tensors(task_id, weights, config, self.shapes, self.max_rank)
        if adapter.nbytes > self.budget_bytes:
            raise RequestError(f"LoRA task {task_id} takes {adapter.nbytes} bytes, over the engine's LoRA cache "
                               f"of {self.budget_bytes} (lora_cache_host_memory_bytes)")
        with self._lock:
            self._adapters.pop(task_id, None)
            while self._adapters and self.nbytes + adapter.nbytes > self.budget_bytes:
                self._adapters.popitem(last=False)
            self._adapters[task_id] = adapter
        return adapter

    def drop(self, task_id: int) -> None:
        """Forget a task (the TensorRT-LLM contract double evicts as upstream's cache would)."""
        with self._lock:
            self._adapters.pop(task_id, None)

    @property
    def nbytes(self) -> int:
        return sum(adapter.nbytes for adapter in self._adapters.values())

    def task_ids(self) -> list[int]:
        with self._lock:
            return list(self._adapters)


class LoraBatch:
    """A step's adapters and the packed rows of each (rows of base requests are in none).

    Every adapter of the step is applied in the same few ops, whatever their number: the adapter rows are gathered
    group by group (each group padded to the largest), multiplied by their own adapter's A and B (two GEMMs and a
    mask, see _add), and added back with one index_add. The adapters' A and B stacked for the step's set of adapters are
    kept (_STACKS) for the next steps with the same set: decode steps rarely change it."""

    def __init__(self, groups: list[tuple[LoraAdapter, torch.Tensor]]):
        groups = sorted(groups, key=lambda group: group[0].task_id)  # one order per set of adapters
        self.groups = groups
        self.adapters = tuple(adapter for adapter, _ in groups)
        self.width = max(len(rows) for _, rows in groups)
        gather = torch.zeros(len(groups), self.width, dtype=torch.long)  # padding reads (and adds 0 to) row 0
        mask = torch.zeros(len(groups), self.width, 1)
        for g, (_, rows) in enumerate(groups):
            gather[g, :len(rows)] = rows
            mask[g, :len(rows)] = 1
        self.gather, self.mask = gather.view(-1), mask
        self._masks: dict[int, torch.Tensor] = {}
        self.stacks = _stacks_for(self.adapters)

    @classmethod
    def of(cls, row_adapters: list[LoraAdapter | None]) -> "LoraBatch | None":
        """From each packed row's adapter (None: the base model); None when no row has one."""
        rows: dict[int, tuple[LoraAdapter, list[int]]] = {}
        for row, adapter in enumerate(row_adapters):
            if adapter is not None:
                rows.setdefault(id(adapter), (adapter, []))[1].append(row)
        if not rows:
            return None
        return cls([(adapter, torch.tensor(indices, dtype=torch.long)) for adapter, indices in rows.values()])

    def add(self, out: torch.Tensor, x: torch.Tensor, layer: int, projection: str, norm=None) -> None:
        """out[rows] += B (A norm(x[rows])) for each adapter's rows and its modules in `projection` (norm: the norm
        the projection's input takes first, where `x` is the residual stream)."""
        stack = self._stack(layer, projection, out.shape[1])
        if stack is not None:
            xr = x.index_select(0, self.gather)
            self._add(out, norm(xr) if norm is not None else xr, stack)

    def add_down(self, out: torch.Tensor, gate_up: torch.Tensor, act, layer: int) -> None:
        """out[rows] += the down projection's adapter of act(gate) x up, computed for the adapters' rows only."""
        stack = self._stack(layer, "down", out.shape[1])
        if stack is not None:
            gate, up = gate_up.index_select(0, self.gather).chunk(2, dim=-1)
            self._add(out, act(gate.contiguous()) * up, stack)

    def _add(self, out: torch.Tensor, xr: torch.Tensor, stack: tuple[torch.Tensor, torch.Tensor]) -> None:
        # Every gathered row against every adapter's A in one GEMM (rank-wide: cheap), the products of other
        # adapters' A masked out, then one GEMM with every adapter's B: small batched products (bmm) cost more here.
        a_cat, b_cat = stack
        h = (xr.float() @ a_cat) * self._mask(a_cat.shape[1] // len(self.groups))
        out.index_add_(0, self.gather, (h @ b_cat).to(out.dtype))

    def _mask(self, rank: int) -> torch.Tensor:
        """[gathered rows, adapters x rank]: 1 where a row's own adapter's columns are, 0 elsewhere and on padding."""
        mask = self._masks.get(rank)
        if mask is None:
            groups = len(self.groups)
            own = torch.arange(groups).repeat_interleave(self.width)[:, None] == \
                torch.arange(groups).repeat_interleave(rank)[None, :]
            mask = self._masks[rank] = own.float() * self.mask.view(-1, 1)
        return mask

    def _stack(self, layer: int, projection: str, width: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(every adapter's A^T side by side [in, adapters x rank], their B^T stacked [adapters x rank, width]) of
        `projection`, zero where an adapter has no module there (ranks padded to the largest); None when no adapter
        has any."""
        key = (layer, projection)
        if key not in self.stacks:
            entries = [adapter.stacked[layer].get(projection) for adapter in self.adapters]
            present = [entry for entry in entries if entry is not None]
            if not present:
                self.stacks[key] = None
            else:
                rank, d_in = max(e[0].shape[0] for e in present), present[0][0].shape[1]
                a_cat = torch.zeros(d_in, len(entries) * rank)
                b_cat = torch.zeros(len(entries) * rank, width)
                for g, entry in enumerate(entries):
                    if entry is not None:
                        a, b, lo, hi = entry
                        a_cat[:, g * rank:g * rank + a.shape[0]] = a.t()
                        b_cat[g * rank:g * rank + a.shape[0], lo:hi] = b.t()
                self.stacks[key] = (a_cat, b_cat)
        return self.stacks[key]

# The adapters' stacked A and B per set of adapters a step ran (LoraBatch), the most recent few kept.
_STACKS: OrderedDict[tuple[LoraAdapter, ...], dict] = OrderedDict()
_STACKS_KEPT = 8


def _stacks_for(adapters: tuple[LoraAdapter, ...]) -> dict:
    """The stacks of this set of adapters (filled as steps need them). Engine thread only."""
    stacks = _STACKS.pop(adapters, None)
    if stacks is None:
        stacks = {}
        while len(_STACKS) >= _STACKS_KEPT:
            _STACKS.popitem(last=False)
    _STACKS[adapters] = stacks
    return stacks
