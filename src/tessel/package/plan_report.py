"""The plan's report: what a build says of the plan it made, as typed objects.

Builds write it into the manifest's `plan`; `tessel inspect` (text, JSON and HTML) reads it by
attribute. Every part may be absent (a package built from pre-sliced models has no solver, a
training step has no mesh choices), and every part read from a package is checked: a report is
data like the rest of the manifest.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from tessel.package.fields import Field

# why a weight is replicated on tensor-parallel axes (`tessel.plan.why.REASONS`)
REPLICATION_REASONS = (
    "buffer", "fixed", "unsplittable", "no_rule", "faster", "memory", "tolerance", "skipped"
)  # fmt: skip


def _opt(f: Field, key: str, read: Any) -> Any:
    return f.get(key, optional=True).optional(read)


def _ints(f: Field) -> tuple[int, ...]:
    return tuple(x.int() for x in f.list())


def _strs(f: Field) -> tuple[str, ...]:
    return tuple(x.str() for x in f.list())


def _drop_empty(out: dict[str, Any]) -> dict[str, Any]:
    """`out` without its absent parts (None), as the report is written."""
    return {k: v for k, v in out.items() if v is not None}


@dataclass(frozen=True)
class CollectiveLine:
    """One collective of a rank's program: its kind, its group's ranks, the bytes it moves."""

    kind: str
    group: tuple[int, ...]
    bytes: int = 0

    @classmethod
    def read(cls, f: Field) -> CollectiveLine:
        f.only(x.name for x in fields(cls))
        return cls(
            f.get("kind").str(),
            _ints(f.get("group")),
            _opt(f, "bytes", Field.int) or 0,
        )

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "group": list(self.group), "bytes": self.bytes}


@dataclass(frozen=True)
class RankLine:
    """One rank as built: its weights, its lowered program's peak, its collectives (a rank of
    a package built from slices names its slice and has no peak counted)."""

    rank: int
    logical_device: str
    weight_bytes: int
    peak_bytes: int | None = None
    collectives: tuple[CollectiveLine, ...] = ()
    slice: str | None = None

    @classmethod
    def read(cls, f: Field) -> RankLine:
        f.only(x.name for x in fields(cls))
        return cls(
            rank=f.get("rank").int(),
            logical_device=f.get("logical_device").str(),
            weight_bytes=f.get("weight_bytes").int(),
            peak_bytes=_opt(f, "peak_bytes", Field.int),
            collectives=tuple(
                CollectiveLine.read(c) for c in _opt(f, "collectives", Field.list) or ()
            ),
            slice=_opt(f, "slice", Field.str),
        )

    def to_json(self) -> dict[str, Any]:
        return _drop_empty(
            {
                "rank": self.rank,
                "logical_device": self.logical_device,
                "slice": self.slice,
                "weight_bytes": self.weight_bytes,
                "peak_bytes": self.peak_bytes,
                "collectives": [c.to_json() for c in self.collectives],
            }
        )


@dataclass(frozen=True)
class MemoryLine:
    """The bytes of one device: the planner's estimate, or (with pipeline stages) what the
    stages' programs hold; beside the smallest device's capacity."""

    device_bytes: int | None = None
    weight_bytes: int | None = None
    peak_bytes: int | None = None  # rank 0's, the outputs gathered to it
    other_ranks_peak_bytes: int | None = None  # a rank no output is gathered to
    rank_peak_bytes: tuple[int, ...] = ()  # each rank's, where the planner counted them

    @classmethod
    def read(cls, f: Field) -> MemoryLine:
        f.only(x.name for x in fields(cls))
        return cls(
            **{
                k: _opt(f, k, Field.int)
                for k in ("device_bytes", "weight_bytes", "peak_bytes", "other_ranks_peak_bytes")
            },
            rank_peak_bytes=_opt(f, "rank_peak_bytes", _ints) or (),
        )

    def to_json(self) -> dict[str, Any]:
        out = _drop_empty({f.name: getattr(self, f.name) for f in fields(self)})
        out["rank_peak_bytes"] = list(self.rank_peak_bytes)
        return out


@dataclass(frozen=True)
class Verified:
    """The build's run of the package against the eager model, or why it did not run."""

    max_relative_diff: float | None = None
    seconds: float | None = None
    skipped: str | None = None

    @classmethod
    def read(cls, f: Field) -> Verified:
        f.only(x.name for x in fields(cls))
        return cls(
            _opt(f, "max_relative_diff", Field.number),
            _opt(f, "seconds", Field.number),
            _opt(f, "skipped", Field.str),
        )

    def to_json(self) -> dict[str, Any]:
        return _drop_empty({f.name: getattr(self, f.name) for f in fields(self)})


@dataclass
class ShapeWeighed:
    """One mesh shape `auto` weighed: its estimates, or why it was set aside; filled in as the
    shapes are weighed."""

    shape: tuple[int, ...]
    dim_names: tuple[str, ...]
    estimated_time_s: float | None = None
    least_time_s: float | None = None  # a time none of its plans beats, where set aside by it
    lowered_time_s: float | None = None  # priced from its programs, where they were lowered
    internode_bytes: float | None = None
    micro_batches: int | None = None  # with pipeline stages
    set_aside: str | None = None
    preferred: str | None = None  # why it was chosen over the fastest
    chosen: bool = False

    @property
    def text(self) -> str:
        return " x ".join(f"{n} {s}" for n, s in zip(self.dim_names, self.shape))

    @classmethod
    def read(cls, f: Field) -> ShapeWeighed:
        f.only(x.name for x in fields(cls))
        shape = tuple(s.int(low=1) for s in f.get("shape").list())
        names = _opt(f, "dim_names", _strs) or ()
        if len(names) != len(shape):
            raise f.fail("expected one name per mesh dimension")
        chosen = f.get("chosen", optional=True).value
        if chosen is not None and not isinstance(chosen, bool):
            raise f.get("chosen").fail(f"expected true or false, found {chosen!r}")
        return cls(
            shape=shape,
            dim_names=names,
            estimated_time_s=_opt(f, "estimated_time_s", Field.number),
            least_time_s=_opt(f, "least_time_s", Field.number),
            lowered_time_s=_opt(f, "lowered_time_s", Field.number),
            internode_bytes=_opt(f, "internode_bytes", Field.number),
            micro_batches=_opt(f, "micro_batches", lambda m: m.int(low=1)),
            set_aside=_opt(f, "set_aside", Field.str),
            preferred=_opt(f, "preferred", Field.str),
            chosen=bool(chosen),
        )

    def to_json(self) -> dict[str, Any]:
        out = _drop_empty({f.name: getattr(self, f.name) for f in fields(self)})
        out["shape"], out["dim_names"] = list(self.shape), list(self.dim_names)
        return out


@dataclass(frozen=True)
class StageLine:
    """One pipeline stage: its layers, its ranks, its weights per device and its time."""

    stage: int
    layers: str
    estimated_time_s: float
    weight_bytes: int
    ranks: tuple[int, ...] = ()

    @classmethod
    def read(cls, f: Field) -> StageLine:
        f.only(x.name for x in fields(cls))
        return cls(
            f.get("stage").int(),
            f.get("layers").str(),
            f.get("estimated_time_s").number(),
            f.get("weight_bytes").int(),
            _opt(f, "ranks", _ints) or (),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "layers": self.layers,
            "estimated_time_s": self.estimated_time_s,
            "weight_bytes": self.weight_bytes,
            "ranks": list(self.ranks),
        }


class _Strings:
    """A record whose every field is a string, read and written field by field."""

    @classmethod
    def read(cls, f: Field) -> Any:
        f.only(x.name for x in fields(cls))  # type: ignore[arg-type]
        return cls(*(f.get(x.name).str() for x in fields(cls)))  # type: ignore[arg-type]

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}  # type: ignore[arg-type]


@dataclass(frozen=True)
class Replan(_Strings):
    """A strategy the lowering could not run and the planner dropped: the node, its operator,
    the strategy, why. (Memory re-plans name the node `(memory)`.)"""

    node: str
    op: str
    strategy: str
    reason: str


@dataclass(frozen=True)
class Fallback(_Strings):
    """A node replicated for lack of a sharding rule."""

    node: str
    op: str
    reason: str


@dataclass(frozen=True)
class SolverLine:
    """How the plan was solved: the level, the method, the problem's size, what it fell back
    to, and the families of identical layers solved once."""

    opt_level: str
    method: str
    variables: int
    constraints: int
    status: str
    fallback: str
    decisions: int
    repeated_layers: Mapping[str, int]

    @classmethod
    def read(cls, f: Field) -> SolverLine:
        f.only(x.name for x in fields(cls))
        return cls(
            opt_level=f.get("opt_level").str(),
            method=f.get("method").str(),
            variables=f.get("variables").int(),
            constraints=f.get("constraints").int(),
            status=f.get("status").str(),
            fallback=f.get("fallback").str(),
            decisions=f.get("decisions").int(),
            repeated_layers={k: v.int() for k, v in f.get("repeated_layers").items()},
        )

    def to_json(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["repeated_layers"] = dict(self.repeated_layers)
        return out


@dataclass(frozen=True)
class TrainingLine:
    """What `tessel inspect` says of a training step: the optimizer, its sharding levels, the
    pipeline, the offload, the precision, and the levels `auto` weighed."""

    optimizer: str
    param_groups: int
    pipeline: str
    sharding: tuple[str, ...]
    optimizer_offload: str
    precision: str
    levels_weighed: tuple[str, ...] = ()

    @classmethod
    def read(cls, f: Field) -> TrainingLine:
        f.only(x.name for x in fields(cls))
        return cls(
            optimizer=f.get("optimizer").str(),
            param_groups=f.get("param_groups").int(),
            pipeline=f.get("pipeline").str(),
            sharding=_strs(f.get("sharding")),
            optimizer_offload=f.get("optimizer_offload").str(),
            precision=f.get("precision").str(),
            levels_weighed=_opt(f, "levels_weighed", _strs) or (),
        )

    def to_json(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["sharding"], out["levels_weighed"] = list(self.sharding), list(self.levels_weighed)
        return out


@dataclass(frozen=True)
class WhyReplicated:
    """Why one weight is replicated on the tensor-parallel axes `axes`, with the planner's
    estimate of the best plan that shards it where one was made (`tessel.plan.why`)."""

    reason: str  # one of REPLICATION_REASONS
    axes: tuple[str, ...]
    text: str
    slower_s: float | None = None  # that plan's estimated time minus the chosen plan's
    sharded: tuple[str, ...] | None = None  # the weight's placements in it
    saves_bytes: int | None = None  # weight bytes per device it holds fewer
    sharded_fits: bool | None = None  # whether it fits the devices' memory

    @classmethod
    def read(cls, f: Field) -> WhyReplicated:
        f.only(x.name for x in fields(cls))
        fits = f.get("sharded_fits", optional=True)
        if fits.value is not None and not isinstance(fits.value, bool):
            raise fits.fail(f"expected true or false, found {fits.value!r}")
        return cls(
            reason=f.get("reason").str(REPLICATION_REASONS),
            axes=_strs(f.get("axes")),
            text=f.get("text").str(),
            slower_s=_opt(f, "slower_s", Field.number),
            sharded=_opt(f, "sharded", _strs),
            saves_bytes=_opt(f, "saves_bytes", lambda b: b.int(low=None)),
            sharded_fits=fits.value,
        )

    def to_json(self) -> dict[str, Any]:
        out = _drop_empty({f.name: getattr(self, f.name) for f in fields(self)})
        out["axes"] = list(self.axes)
        if self.sharded is not None:
            out["sharded"] = list(self.sharded)
        return out


@dataclass(frozen=True)
class PlanReport:
    """What a build says of its plan: the estimates, the solver, the memory, each layer's
    placements, each rank's program, the mesh shapes weighed, the stages, the check against
    eager. A package built from slices says where they came from instead of how they were
    planned (`source` "slices")."""

    source: str = "planned"
    estimated_time_s: float | None = None
    lowered_time_s: float | None = None  # the same run priced from its lowered programs
    solver: SolverLine | None = None
    memory: MemoryLine = MemoryLine()
    # layer -> weight -> its placement on each mesh axis
    layers: Mapping[str, Mapping[str, tuple[str, ...]]] = field(default_factory=dict)
    fallbacks: tuple[Fallback, ...] = ()
    fallback_ops: Mapping[str, int] = field(default_factory=dict)
    replanned: tuple[Replan, ...] = ()
    replicated: Mapping[str, WhyReplicated] = field(default_factory=dict)  # on tp axes, why
    ranks: tuple[RankLine, ...] = ()
    mesh_choices: tuple[ShapeWeighed, ...] = ()
    stages: tuple[StageLine, ...] = ()
    micro_batches: int = 1
    verify: Verified | None = None
    training: TrainingLine | None = None
    relation_config: str | None = None  # built from slices: the model relation config
    groups: Mapping[str, tuple[int, ...]] = field(default_factory=dict)  # and its groups

    @classmethod
    def read(cls, f: Field) -> PlanReport:
        """The report at `f` (absent: an empty one), checked part by part."""
        if f.value is None:
            return cls()
        f.only(x.name for x in fields(cls))
        return cls(
            source=_opt(f, "source", lambda s: s.str(("planned", "slices"))) or "planned",
            estimated_time_s=_opt(f, "estimated_time_s", Field.number),
            lowered_time_s=_opt(f, "lowered_time_s", Field.number),
            solver=_opt(f, "solver", SolverLine.read),
            memory=_opt(f, "memory", MemoryLine.read) or MemoryLine(),
            layers={
                layer: {name: _strs(p) for name, p in params.items()}
                for layer, params in (_opt(f, "layers", Field.items) or ())
            },
            fallbacks=tuple(Fallback.read(x) for x in _opt(f, "fallbacks", Field.list) or ()),
            fallback_ops={k: v.int() for k, v in _opt(f, "fallback_ops", Field.items) or ()},
            replanned=tuple(Replan.read(x) for x in _opt(f, "replanned", Field.list) or ()),
            replicated={
                k: WhyReplicated.read(v) for k, v in _opt(f, "replicated", Field.items) or ()
            },
            ranks=tuple(RankLine.read(x) for x in _opt(f, "ranks", Field.list) or ()),
            mesh_choices=tuple(
                ShapeWeighed.read(x) for x in _opt(f, "mesh_choices", Field.list) or ()
            ),
            stages=tuple(StageLine.read(x) for x in _opt(f, "stages", Field.list) or ()),
            micro_batches=_opt(f, "micro_batches", lambda m: m.int(low=1)) or 1,
            verify=_opt(f, "verify", Verified.read),
            training=_opt(f, "training", TrainingLine.read),
            relation_config=_opt(f, "relation_config", Field.str),
            groups={k: _ints(v) for k, v in _opt(f, "groups", Field.items) or ()},
        )

    def to_json(self) -> dict[str, Any]:
        return _drop_empty(
            {
                "source": self.source,
                "estimated_time_s": self.estimated_time_s,
                "lowered_time_s": self.lowered_time_s,
                "solver": self.solver.to_json() if self.solver else None,
                "memory": self.memory.to_json(),
                "layers": {k: {n: list(p) for n, p in v.items()} for k, v in self.layers.items()},
                "fallbacks": [x.to_json() for x in self.fallbacks],
                "fallback_ops": dict(self.fallback_ops),
                "replanned": [x.to_json() for x in self.replanned],
                "replicated": {k: r.to_json() for k, r in self.replicated.items()},
                "ranks": [r.to_json() for r in self.ranks],
                "mesh_choices": [c.to_json() for c in self.mesh_choices],
                "stages": [s.to_json() for s in self.stages],
                "micro_batches": self.micro_batches,
                "verify": self.verify.to_json() if self.verify else None,
                "training": self.training.to_json() if self.training else None,
                "relation_config": self.relation_config,
                "groups": {k: list(g) for k, g in self.groups.items()},
            }
        )
