"""The manifest of an offline model as typed, frozen objects, checked field by field on load.

A package may come from anywhere, so nothing in its manifest is trusted: every field is checked
for its type, its range and its agreement with the rest (ranks 0..n-1, members that exist, shapes
of non-negative sizes, known dtypes) before any of it is used, and a wrong field is named by its
key path. This module needs no torch, so tools that only read a manifest start fast.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from tessel.config.errors import ConfigError
from tessel.config.optimizer import spec_from_json
from tessel.config.sampling import MODEL_SETTINGS, Setting, check_settings_in_range
from tessel.package.fields import Field, PackageError, valid_member_name
from tessel.package.plan_report import PlanReport
from tessel.schedules import Handoff, Phase
from tessel.sharding.geometry import Box

FORMAT = "tessel.offline_model"
FORMAT_VERSION = 2  # 2: a submodel may name tied weights, stored once
READABLE_VERSIONS = (1, 2)
MANIFEST = "manifest.json"
MODES = ("partitioned", "replicated", "training")
# torch dtype names (without "torch.") that packages carry: those safetensors can store
DTYPES = frozenset(
    {
        "float64",
        "float32",
        "float16",
        "bfloat16",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "bool",
        "float8_e4m3fn",
        "float8_e5m2",
    }
)
_SHA256 = re.compile(r"[0-9a-f]{64}")


def dtype_bytes(name: str) -> int:
    """Bytes per element of a dtype the manifest names."""
    if name == "bool" or name.endswith("8") or "float8" in name:
        return 1
    return int(re.sub(r"\D", "", name)) // 8


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of a model input or output; inputs have a name, integer inputs a bound."""

    shape: tuple[int, ...]
    dtype: str
    name: str | None = None
    high: int | None = None  # integer inputs: `tessel run` draws random values below this

    @classmethod
    def read(cls, f: Field, named: bool) -> TensorSpec:
        f.only(("shape", "dtype", "name", "high") if named else ("shape", "dtype", "name"))
        return cls(
            shape=_shape(f.get("shape")),
            dtype=f.get("dtype").str(sorted(DTYPES)),
            name=f.get("name").str()
            if named
            else f.get("name", optional=True).optional(lambda n: n.str()),
            high=f.get("high", optional=True).optional(lambda h: h.int(low=1)),
        )

    def to_json(self) -> dict:
        out: dict[str, Any] = {"shape": list(self.shape), "dtype": self.dtype}
        if self.name is not None:
            out["name"] = self.name
        if self.high is not None:
            out["high"] = self.high
        return out


@dataclass(frozen=True)
class Tie:
    """A weight stored under another name: its source and the (dim, count, index) chunks of it
    this rank holds."""

    source: str
    chunks: tuple[tuple[int, int, int], ...] = ()

    @classmethod
    def read(cls, f: Field) -> Tie:
        f.only(("source", "chunks"))
        chunks = []
        for c in f.get("chunks", optional=True).optional(Field.list) or []:
            parts = c.list()
            if len(parts) != 3:
                raise c.fail(f"expected [dim, count, index], found {c._found()}")
            dim, count = parts[0].int(high=64), parts[1].int(low=1)
            chunks.append((dim, count, parts[2].int(high=count - 1)))
        return cls(f.get("source").str(), tuple(chunks))

    def to_json(self) -> dict:
        return {"source": self.source, "chunks": [list(c) for c in self.chunks]}


@dataclass(frozen=True)
class Passes:
    """A training pipeline stage on one rank: its backward pass beside its forward pass
    (`Submodel.program`), each over one micro-batch, and the handoffs of its replica's pipeline
    in the order the passes take and make them. The forward pass returns the handoffs it sends,
    then the `saved` tensors its backward pass takes after its handoffs; the pass `loss` of
    the pipeline returns the micro-batch's loss last."""

    backward: str
    handoffs: tuple[Handoff, ...]
    saved: int
    loss: tuple[Phase, int]

    @classmethod
    def read(cls, f: Field, members: frozenset[str]) -> Passes:
        f.only(("backward", "handoffs", "saved", "loss"))
        handoffs = []
        for h in f.get("handoffs").list():
            h.only(("sender", "receiver", "shape", "dtype", "once"))
            once = h.get("once").value
            if not isinstance(once, bool):
                raise h.get("once")._expect("true or false")
            handoffs.append(
                Handoff(
                    _pass(h.get("sender")),
                    _pass(h.get("receiver")),
                    _shape(h.get("shape")),
                    h.get("dtype").str(sorted(DTYPES)),
                    once,
                )
            )
        return cls(
            f.get("backward").member(members),
            tuple(handoffs),
            f.get("saved").int(high=1 << 20),
            _pass(f.get("loss")),
        )

    def taken(self, phase: Phase, stage: int) -> int:
        """How many tensors stage `stage`'s pass of `phase` takes after the weights and the
        model's inputs: the handoffs it receives (and, backward, what was saved for it)."""
        received = sum(1 for h in self.handoffs if h.receiver == (phase, stage))
        return received + (self.saved if phase == "B" else 0)

    def to_json(self) -> dict:
        return {
            "backward": self.backward,
            "handoffs": [h.to_json() for h in self.handoffs],
            "saved": self.saved,
            "loss": list(self.loss),
        }


def _check_stages(f: Field, passes: Passes, stages: int) -> None:
    """Every pass `passes` names is one of the mesh's `stages` stages'."""
    named = [("loss", passes.loss)] + [
        (f"handoffs[{i}].{end}", getattr(h, end))
        for i, h in enumerate(passes.handoffs)
        for end in ("sender", "receiver")
    ]
    for key, (_, stage) in named:
        if stage >= stages:
            raise Field(None, f"{f.key}.{key}", f.source).fail(
                f"names stage {stage}; the mesh has {stages} pipeline stages"
            )


def _pass(f: Field) -> tuple[Phase, int]:
    """A pass as ["F" or "B", stage]."""
    parts = f.list()
    if len(parts) != 2:
        raise f.fail(f"expected [phase, stage], found {f._found()}")
    phase: Phase = "F" if parts[0].str(("F", "B")) == "F" else "B"
    return phase, parts[1].int(high=1 << 20)


@dataclass(frozen=True)
class Submodel:
    """One rank: where it runs, its program and weight members, and the groups it talks in."""

    rank: int
    logical_device: str
    node_id: int
    device_id: int
    program: str
    weights: tuple[str, ...]
    weight_order: tuple[str, ...]
    tied: Mapping[str, Tie]
    # each a process group over its ranks; the same ranks in another order are another group
    comm_groups: tuple[tuple[int, ...], ...]
    # a generation package's prefill programs by prompt length (`program` is its decode gear)
    gears: Mapping[int, str] = field(default_factory=dict)
    # its one-row prefill programs by prompt length (`Gears.row_prefill`)
    row_gears: Mapping[int, str] = field(default_factory=dict)
    # the state this rank holds, zero at load and written by its programs: name -> its box,
    # a (start, stop) per dim of the whole tensor
    state: Mapping[str, Box] = field(default_factory=dict)
    # a training pipeline stage's passes (`program` is its forward pass)
    passes: Passes | None = None

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        """Each state's local shape on this rank."""
        return {name: tuple(b - a for a, b in box) for name, box in self.state.items()}

    @classmethod
    def read(cls, f: Field, rank: int, world: int, members: frozenset[str]) -> Submodel:
        f.only(x.name for x in fields(cls))
        weights = f.get("weights")
        if isinstance(weights.value, str):  # early version 1 packages named one member
            weights = Field([weights.value], weights.key, weights.source)
        groups = []
        for g in f.get("comm_groups").list():
            ranks = tuple(r.int(high=world - 1) for r in g.list())
            if not ranks or len(set(ranks)) != len(ranks):
                raise g.fail(f"expected distinct ranks, found {g._found()}")
            groups.append(ranks)
        order = tuple(w.str() for w in f.get("weight_order").list())
        if len(set(order)) != len(order):
            raise f.get("weight_order").fail("names a weight twice")
        tied_f = f.get("tied", optional=True)
        tied = {k: Tie.read(v) for k, v in tied_f.items()} if tied_f.value is not None else {}
        gears, row_gears = (
            _gears(f.get("gears", optional=True), members),
            _gears(f.get("row_gears", optional=True), members),
        )
        state_f = f.get("state", optional=True)
        state = {k: _box(v) for k, v in state_f.items()} if state_f.value is not None else {}
        if not set(state) <= set(order):
            raise state_f.fail(
                f"names state the rank's programs do not take: {sorted(set(state) - set(order))}"
            )
        got = f.get("rank").int()
        if got != rank:
            raise f.get("rank").fail(f"expected {rank} (submodels are listed by rank), found {got}")
        return cls(
            rank=rank,
            logical_device=f.get("logical_device").str(),
            node_id=f.get("node_id").int(),
            device_id=f.get("device_id").int(),
            program=f.get("program").member(members),
            weights=tuple(w.member(members) for w in weights.list()),
            weight_order=order,
            tied=tied,
            comm_groups=tuple(groups),
            gears=gears,
            row_gears=row_gears,
            state=state,
            passes=f.get("passes", optional=True).optional(lambda p: Passes.read(p, members)),
        )

    def to_json(self) -> dict:
        return {
            "rank": self.rank,
            "logical_device": self.logical_device,
            "node_id": self.node_id,
            "device_id": self.device_id,
            "program": self.program,
            "weights": list(self.weights),
            "weight_order": list(self.weight_order),
            "tied": {k: t.to_json() for k, t in self.tied.items()},
            "comm_groups": [list(g) for g in self.comm_groups],
            **({"gears": {str(n): m for n, m in self.gears.items()}} if self.gears else {}),
            **(
                {"row_gears": {str(n): m for n, m in self.row_gears.items()}}
                if self.row_gears
                else {}
            ),
            **(
                {"state": {k: [list(d) for d in box] for k, box in self.state.items()}}
                if self.state
                else {}
            ),
            **({"passes": self.passes.to_json()} if self.passes is not None else {}),
        }


@dataclass(frozen=True)
class Mesh:
    shape: tuple[int, ...]
    dim_names: tuple[str, ...]

    @classmethod
    def read(cls, f: Field) -> Mesh:
        f.only(("shape", "dim_names"))
        shape = tuple(s.int(low=1) for s in f.get("shape").list())
        names = tuple(s.str() for s in f.get("dim_names").list())
        if not shape or len(names) != len(shape):
            raise f.fail(f"expected one name per mesh dimension, found {f._found()}")
        return cls(shape, names)

    def to_json(self) -> dict:
        return {"shape": list(self.shape), "dim_names": list(self.dim_names)}

    def size(self, axis: str) -> int:
        """The size of the axis named `axis`; 1 where the mesh has none (one replica, one
        stage)."""
        return math.prod(s for s, n in zip(self.shape, self.dim_names) if n == axis)

    def stage_of(self, rank: int) -> int:
        """The pipeline stage of `rank` (its mesh axes outermost first: pp, dp, then tp)."""
        return rank // (self.size("dp") * self.tensor_parallel)

    @property
    def tensor_parallel(self) -> int:
        """The ranks of one replica of one stage: the axes other than `pp` and `dp`."""
        return math.prod(s for s, n in zip(self.shape, self.dim_names) if n not in ("pp", "dp"))

    @property
    def logits_rank(self) -> int:
        """The first rank of the last pipeline stage (rank 0 without stages): a generation
        gear's logits are there, and its token is chosen there."""
        world = math.prod(self.shape)
        return world - world // self.size("pp")


# the mesh's sizes as packages of earlier tessels repeated them in `training`
_MESH_SIZES: dict[str, Callable[[Mesh], int]] = {
    "data_parallel": lambda mesh: mesh.size("dp"),
    "tensor_parallel": lambda mesh: mesh.tensor_parallel,
    "pipeline_stages": lambda mesh: mesh.size("pp"),
}


@dataclass(frozen=True)
class Training:
    """A training package's step: the optimizer (as data), whose gradient each program output
    after the loss is, and how the data-parallel replicas share gradients and states."""

    optimizer: Mapping[str, Any]  # checked where it is built (`tessel.config.optimizer`)
    gradients: tuple[str, ...]
    optimizer_state_sharding: bool
    gradient_sharding: bool
    weight_sharding: bool
    # bytes of gathered weights fetched ahead of their use at once (0: no prefetch)
    weight_prefetch_bytes: int
    # the trained weights gathered and reduced together, each named once
    units: tuple[tuple[str, ...], ...]
    # what the program computes in; the package's trained weights are its fp32 master copy
    compute_dtype: str
    optimizer_offload: str
    # each step runs this many micro-batches through the pipeline stages (the mesh's `pp`
    # axis) and sums their gradients
    micro_batches: int = 1
    # each key of the model's state_dict() a checkpoint holds, to the checkpoint name of its
    # value (tied keys as transformers saves them); None in packages built before it was kept
    state_dict: Mapping[str, str] | None = None
    # members holding a transformers model's config.json and generation_config.json
    model_config: str | None = None
    generation_config: str | None = None

    @classmethod
    def read(cls, f: Field, mesh: Mesh, members: frozenset[str] = frozenset()) -> Training:
        f.only([*(x.name for x in fields(cls)), *_MESH_SIZES])
        for key, size_of in _MESH_SIZES.items():  # packages of earlier tessels repeat the mesh
            size = f.get(key, optional=True).optional(lambda v: v.int(low=1))
            if size is not None and size != size_of(mesh):
                raise f.get(key).fail(
                    f"is {size}, but the mesh {list(mesh.shape)} {list(mesh.dim_names)} has "
                    f"{size_of(mesh)}"
                )
        micro_batches = f.get("micro_batches", optional=True).optional(lambda v: v.int(low=1))
        flags = {}
        for key in ("optimizer_state_sharding", "gradient_sharding", "weight_sharding"):
            value = f.get(key).value
            if not isinstance(value, bool):
                raise f.get(key)._expect("true or false")
            flags[key] = value
        if flags["weight_sharding"] and not flags["gradient_sharding"]:
            raise f.get("weight_sharding").fail("weight sharding needs gradient sharding")
        if flags["gradient_sharding"] and not flags["optimizer_state_sharding"]:
            raise f.get("gradient_sharding").fail(
                "gradient sharding needs optimizer state sharding"
            )
        gradients = tuple(g.str() for g in f.get("gradients").list())
        units = tuple(tuple(n.str() for n in u.list()) for u in f.get("units").list())
        if sorted(n for u in units for n in u) != sorted(gradients):
            raise f.get("units").fail("expected every trained weight in one unit, once")
        optimizer = f.get("optimizer")
        try:  # as torch's constructor checks it, over the weights the step trains
            spec_from_json(optimizer.obj(), f.source, gradients)
        except ConfigError as exc:
            key = (exc.key or "").removeprefix("training.")
            raise Field(None, f"{f.key}.{key}" if key else f.key, f.source).fail(
                exc.detail
            ) from None
        return cls(
            optimizer=optimizer.obj(),
            gradients=gradients,
            weight_prefetch_bytes=f.get("weight_prefetch_bytes").int(low=0),
            units=units,
            compute_dtype=f.get("compute_dtype").str(("float32", "bfloat16")),
            optimizer_offload=f.get("optimizer_offload").str(("none", "cpu")),
            micro_batches=micro_batches or 1,
            state_dict=f.get("state_dict", optional=True).optional(_state_dict),
            model_config=f.get("model_config", optional=True).optional(lambda m: m.member(members)),
            generation_config=f.get("generation_config", optional=True).optional(
                lambda m: m.member(members)
            ),
            **flags,
        )

    def to_json(self) -> dict:
        return {
            "optimizer": self.optimizer,
            "gradients": list(self.gradients),
            "optimizer_state_sharding": self.optimizer_state_sharding,
            "gradient_sharding": self.gradient_sharding,
            "weight_sharding": self.weight_sharding,
            "weight_prefetch_bytes": self.weight_prefetch_bytes,
            "units": [list(u) for u in self.units],
            "compute_dtype": self.compute_dtype,
            "optimizer_offload": self.optimizer_offload,
            "micro_batches": self.micro_batches,
            **({"state_dict": dict(self.state_dict)} if self.state_dict is not None else {}),
            **({"model_config": self.model_config} if self.model_config else {}),
            **({"generation_config": self.generation_config} if self.generation_config else {}),
        }


@dataclass(frozen=True)
class Gears:
    """A generation package's shapes: its cache's rows and slots, the prompt lengths of its
    prefill gears, the vocabulary, the tokens its model pads and stops with, and the state
    every gear writes in place (global shapes; each rank's part in its submodel)."""

    max_batch_size: int
    max_seq_len: int
    prefill_lengths: tuple[int, ...]
    vocab_size: int
    state: tuple[TensorSpec, ...]
    pad_token_id: int | None = None  # None: the model sets none (see `pad_for`)
    eos_token_id: tuple[int, ...] = ()  # a row stops at any of them (none: at no token)
    # the model's own decoding settings (its generation_config, `MODEL_SETTINGS`), which
    # `generate` applies where a call does not set them, as `transformers` does
    defaults: Mapping[str, Setting] = field(default_factory=dict)
    # an encoder-decoder's: the token its decoder starts from, which `generate` returns first
    # (the prompt went to the encoder); None for a decoder-only model
    decoder_start_token_id: int | None = None
    # each prompt length has a one-row prefill gear too (every rank's `row_gears`)
    row_prefill: bool = False

    def pad_for(self, eos_token_id: tuple[int, ...]) -> int:
        """The id finished rows are padded with: the model's, or where it sets none the first
        of the request's eos tokens (as `transformers`' `generate` does), else 0."""
        if self.pad_token_id is not None:
            return self.pad_token_id
        return eos_token_id[0] if eos_token_id else 0

    @classmethod
    def read(cls, f: Field) -> Gears:
        f.only(x.name for x in fields(cls))
        seq = f.get("max_seq_len").int(low=2)
        lengths = tuple(n.int(low=1, high=seq - 1) for n in f.get("prefill_lengths").list())
        if not lengths or list(lengths) != sorted(set(lengths)):
            raise f.get("prefill_lengths").fail("expected prompt lengths in rising order")
        vocab = f.get("vocab_size").int(low=1)
        return cls(
            max_batch_size=f.get("max_batch_size").int(low=1),
            max_seq_len=seq,
            prefill_lengths=lengths,
            vocab_size=vocab,
            state=tuple(TensorSpec.read(x, named=True) for x in f.get("state").list()),
            pad_token_id=f.get("pad_token_id", optional=True).optional(
                lambda p: p.int(low=0, high=vocab - 1)
            ),
            eos_token_id=_token_ids(f.get("eos_token_id", optional=True), vocab),
            defaults=f.get("defaults", optional=True).optional(lambda d: _model_settings(d, vocab))
            or {},
            decoder_start_token_id=f.get("decoder_start_token_id", optional=True).optional(
                lambda p: p.int(low=0, high=vocab - 1)
            ),
            row_prefill=f.get("row_prefill", optional=True).optional(lambda p: p.flag()) or False,
        )

    def to_json(self) -> dict:
        return {
            "max_batch_size": self.max_batch_size,
            "max_seq_len": self.max_seq_len,
            "prefill_lengths": list(self.prefill_lengths),
            "vocab_size": self.vocab_size,
            "state": [x.to_json() for x in self.state],
            **({"pad_token_id": self.pad_token_id} if self.pad_token_id is not None else {}),
            **({"eos_token_id": list(self.eos_token_id)} if self.eos_token_id else {}),
            **({"defaults": dict(self.defaults)} if self.defaults else {}),
            **(
                {"decoder_start_token_id": self.decoder_start_token_id}
                if self.decoder_start_token_id is not None
                else {}
            ),
            **({"row_prefill": True} if self.row_prefill else {}),
        }


def _model_settings(f: Field, vocab: int) -> dict[str, Setting]:
    """A model's decoding settings, each one `transformers`' `generate` would accept."""
    f.only(MODEL_SETTINGS)
    settings: dict[str, Setting] = {}
    for key, value in f.items():
        if key == "do_sample":
            if not isinstance(value.value, bool):
                raise value.fail(f"expected true or false, found {value.value!r}")
            settings[key] = value.value
        elif key in ("suppress_tokens", "forced_eos_token_id"):
            settings[key] = [x.int(low=0, high=vocab - 1) for x in value.list()]
        elif key == "forced_bos_token_id":
            settings[key] = value.int(low=0, high=vocab - 1)
        else:
            settings[key] = value.number() if isinstance(value.value, float) else value.int()
    try:
        check_settings_in_range(settings)
    except ConfigError as exc:
        raise f.get(str(exc.key)).fail(str(exc.detail)) from None
    return settings


def _token_ids(f: Field, vocab: int) -> tuple[int, ...]:
    """One token id or a list of them, as `generation_config.json` gives `eos_token_id`."""
    if f.value is None:
        return ()
    ids = f.list() if isinstance(f.value, list) else [f]
    return tuple(x.int(low=0, high=vocab - 1) for x in ids)


@dataclass(frozen=True)
class Manifest:
    """What `manifest.json` records: how the model was built, per-rank submodels, member checksums."""

    format_version: int
    tessel_version: str
    torch_version: str
    mode: str
    soc_version: str
    device_type: str
    backend: str
    world_size: int
    cluster: Mapping[str, Any]  # the cluster config as given; parsed where workers start
    mesh: Mesh
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...] | None  # absent in early version 1 packages
    submodels: tuple[Submodel, ...]
    layouts: str
    strategy: str | None  # absent in early version 1 packages
    plan: PlanReport  # what the build says of its plan, for `tessel inspect`
    timings: Mapping[str, float] = field(default_factory=dict)
    files: Mapping[str, str] = field(default_factory=dict)  # member -> SHA-256
    training: Training | None = None  # a training step's package only
    generation: Gears | None = None  # a generation package's gears and state only

    format = FORMAT

    @classmethod
    def from_json(
        cls, obj: Any, source: Any = MANIFEST, members: Iterable[str] | None = None
    ) -> Manifest:
        """Check a parsed manifest and type it; raises `PackageError` naming the wrong key.

        `members` are the member names the package holds; by default the manifest's own
        `files`, which must then be present (a manifest about to be written has none yet).
        """
        source = str(source)
        top = Field(obj, "", source)
        if not isinstance(obj, dict):
            raise PackageError(source, f"manifest: expected an object, found {top._found()}")
        fmt = top.get("format")
        if fmt.value != FORMAT:
            raise PackageError(source, f"not a tessel offline model (format {fmt.value!r})")
        version = top.get("format_version", optional=True).value
        if isinstance(version, bool) or version not in READABLE_VERSIONS:
            raise PackageError(
                source,
                f"format version {version!r} is not supported; this tessel reads versions "
                f"{', '.join(map(str, READABLE_VERSIONS))} (rebuild the model with this tessel)",
            )
        top.only([*(x.name for x in fields(cls)), "format"])
        files: dict[str, str] = {}
        if members is None:
            for name, sha in top.get("files").items():
                if not valid_member_name(name) or name == MANIFEST:
                    raise sha.fail(f"{name!r} is not a valid member name")
                if _SHA256.fullmatch(sha.str()) is None:
                    raise sha.fail("expected a SHA-256 in lower-case hex")
                files[name] = sha.value
            names = frozenset(files)
        else:
            names = frozenset(members)
        world = top.get("world_size").int(low=1, high=1 << 20)
        mode = top.get("mode").str(MODES)
        if (mode == "training") != ("training" in obj):
            raise top.get("mode").fail(
                f"is {mode!r}, but the manifest {'lacks' if mode == 'training' else 'has'} a "
                "'training' section"
            )
        mesh = Mesh.read(top.get("mesh"))
        want = 1 if mode == "replicated" else world
        if math.prod(mesh.shape) != want:
            raise top.get("mesh").fail(
                f"a {mode} model on {world} devices needs a mesh of {want} devices, "
                f"found shape {list(mesh.shape)}"
            )
        subs = top.get("submodels").list()
        if len(subs) != world:
            raise top.get("submodels").fail(
                f"expected one submodel per device ({world}), found {len(subs)}"
            )
        inputs = tuple(TensorSpec.read(i, named=True) for i in top.get("inputs").list())
        input_names = [i.name for i in inputs]
        if len(set(input_names)) != len(input_names):
            raise top.get("inputs").fail(f"names an input twice: {input_names}")
        outputs = top.get("outputs", optional=True).optional(
            lambda o: tuple(TensorSpec.read(x, named=False) for x in o.list())
        )
        timings = {k: v.number() for k, v in top.get("timings").items()} if "timings" in obj else {}
        submodels = tuple(Submodel.read(s, r, world, names) for r, s in enumerate(subs))
        staged = mode == "training" and mesh.size("pp") > 1
        for r, sub in enumerate(submodels):
            if sub.passes is not None and staged:
                _check_stages(subs[r].get("passes"), sub.passes, mesh.size("pp"))
            if (sub.passes is not None) != staged:
                raise subs[r].fail(
                    "has no forward and backward passes for its pipeline stage: the package was "
                    "built by an earlier tessel, which ran a stage as one program over every "
                    "micro-batch; build it again"
                    if staged
                    else "has pipeline passes, but the model is no training pipeline"
                )
        return cls(
            format_version=version,
            tessel_version=top.get("tessel_version").str(),
            torch_version=top.get("torch_version").str(),
            mode=mode,
            soc_version=top.get("soc_version").str(),
            device_type=top.get("device_type").str(),
            backend=top.get("backend").str(),
            world_size=world,
            cluster=top.get("cluster").obj(),
            mesh=mesh,
            inputs=inputs,
            outputs=outputs,
            submodels=submodels,
            layouts=top.get("layouts").member(names),
            strategy=top.get("strategy", optional=True).optional(lambda s: s.member(names)),
            plan=PlanReport.read(top.get("plan", optional=True)),
            timings=timings,
            files=files,
            training=top.get("training", optional=True).optional(
                lambda t: Training.read(t, mesh, names)
            ),
            generation=_checked_state(
                top.get("generation", optional=True).optional(Gears.read), subs
            ),
        )

    def to_json(self) -> dict:
        """The manifest as `manifest.json` holds it."""
        out: dict[str, Any] = {
            "format": FORMAT,
            "format_version": self.format_version,
            "tessel_version": self.tessel_version,
            "torch_version": self.torch_version,
            "mode": self.mode,
            "soc_version": self.soc_version,
            "device_type": self.device_type,
            "backend": self.backend,
            "world_size": self.world_size,
            "cluster": self.cluster,
            "mesh": self.mesh.to_json(),
            "inputs": [i.to_json() for i in self.inputs],
            "submodels": [s.to_json() for s in self.submodels],
            "layouts": self.layouts,
            "plan": self.plan.to_json(),
            "timings": dict(self.timings),
            "files": dict(self.files),
        }
        if self.outputs is not None:
            out["outputs"] = [o.to_json() for o in self.outputs]
        if self.strategy is not None:
            out["strategy"] = self.strategy
        if self.training is not None:
            out["training"] = self.training.to_json()
        if self.generation is not None:
            out["generation"] = self.generation.to_json()
        return out

    def with_files(self, files: Mapping[str, str]) -> Manifest:
        """This manifest with the members' checksums recorded."""
        return replace(self, files=dict(files))

    def submodel(self, rank: int) -> Submodel:
        if not 0 <= rank < self.world_size:
            raise PackageError(
                MANIFEST, f"rank {rank} is outside this model's {self.world_size} devices"
            )
        return self.submodels[rank]

    def member_names(self) -> set[str]:
        """Every member the manifest refers to."""
        names = {self.layouts, *([self.strategy] if self.strategy else [])}
        if self.training is not None:
            names.update(
                m for m in (self.training.model_config, self.training.generation_config) if m
            )
        for s in self.submodels:
            names.add(s.program)
            names.update(s.weights)
            names.update(s.gears.values())
            names.update(s.row_gears.values())
        return names

    def __repr__(self) -> str:
        shown = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self)[:8])
        return f"Manifest({shown}, ...)"


def _state_dict(f: Field) -> dict[str, str]:
    """`training.state_dict`: non-empty key names to non-empty checkpoint names."""
    out = {}
    for key, name in f.items():
        if not key:
            raise name.fail("expected non-empty state_dict keys")
        if not name.str():
            raise name.fail("expected a checkpoint name, found an empty string")
        out[key] = name.value
    return out


def _box(f: Field) -> Box:
    """A rank's box of a state tensor: [start, stop] per dim (a bare list of ints, as the first
    generation packages wrote, is the box from 0 of that shape)."""
    dims = f.list()
    if all(isinstance(d.value, int) for d in dims):
        return tuple((0, n) for n in _shape(f))
    box = []
    for d in dims:
        pair = d.list()
        if len(pair) != 2:
            raise d.fail(f"expected [start, stop], found {d._found()}")
        start, stop = pair[0].int(high=1 << 62), pair[1].int(high=1 << 62)
        if stop < start:
            raise d.fail(f"expected start <= stop, found [{start}, {stop}]")
        box.append((start, stop))
    return tuple(box)


def _gears(f: Field, members: frozenset[str]) -> dict[int, str]:
    """A submodel's prefill programs (`gears`, `row_gears`): prompt length -> member."""
    gears = {}
    for length, member in f.items() if f.value is not None else []:
        if not length.isdigit() or int(length) < 1:
            raise member.fail(f"names a prefill gear {length!r}; expected a prompt length")
        gears[int(length)] = member.member(members)
    return gears


def _checked_state(gears: Gears | None, subs: list[Field]) -> Gears | None:
    """Every rank's state boxes lie inside the state the generation section declares, and
    every rank holds a one-row prefill gear per prompt length where the section says so."""
    declared = {x.name: x.shape for x in gears.state} if gears is not None else {}
    for sub in subs:
        rows_f = sub.get("row_gears", optional=True)
        held = sorted(int(n) for n, _ in rows_f.items()) if rows_f.value is not None else []
        wanted = list(gears.prefill_lengths) if gears is not None and gears.row_prefill else []
        if held != wanted:
            raise (rows_f if rows_f.value is not None else sub).fail(
                f"holds one-row prefill gears for prompt lengths {held}; the generation "
                f"section's row_prefill asks for {wanted}"
            )
        state_f = sub.get("state", optional=True)
        for name, box_f in state_f.items() if state_f.value is not None else []:
            if name not in declared:
                raise box_f.fail("is state the manifest's generation section does not declare")
            box, shape = _box(box_f), declared[name]
            if len(box) != len(shape) or any(b > n for (_, b), n in zip(box, shape)):
                raise box_f.fail(f"is not a box of the declared shape {list(shape)}")
    return gears


def _shape(f: Field) -> tuple[int, ...]:
    dims = f.list()
    if len(dims) > 64:
        raise f.fail(f"expected at most 64 dimensions, found {len(dims)}")
    return tuple(d.int(high=1 << 62) for d in dims)
