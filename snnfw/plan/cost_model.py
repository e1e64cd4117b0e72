"""Predicts a training step in milliseconds, and learns from the steps ``snnfw bench`` measured.

A candidate's step, as the model sees it on its busiest rank (:class:`StepTerms`):

- **compute**: forward and backward of the rank's samples, from a profile of the model on this device (per
  sample, at a rank's share of the cores), divided as the strategy divides it, stretched by the pipeline bubble
  ``(p-1)/(m+p-1)``, and by the cores' oversubscription where more ranks than cores share a host;
- **optimizer**: the profiled optimizer step, for the share of the parameters the rank holds;
- **communication**: per collective kind, the bytes the step carries and its number of calls (counted by the
  dry run, or the strategy's own estimate of bytes), over the bandwidth and latency of that kind on this
  cluster (:class:`Cluster`: a probe's measurements, or stated assumptions).

Uncorrected, the prediction is compute + optimizer + communication. :func:`fit` learns, from bench records that
carry the terms the model gave them, a factor per strategy: the median ratio of its measured steps to their
uncorrected predictions, from 2 of its records or more (what a strategy adds that no term sees, the waits of
its collectives inside forward and backward, is its own), learned apart for each mesh layout of it with 2
records or more (:func:`layout`: ``pp`` alone and ``pp x dp``); and, for strategies with fewer records, a per-step
overhead (the loop, logging, data), a factor on compute and one on communication, fitted over every record
(least squares on relative error, none negative: 3 records or more). A factor per strategy fitted on what the
shared terms left over was tried first: the shared terms, fitted mostly on the strategies that wait, then made
the others' steps worse (``docs/benchmarks.md``). Every figure is kept with where it came from
(:attr:`Prediction.lines`).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import statistics
from pathlib import Path

import attrs

from snnfw.config import COMPOSED
from snnfw.errors import UserError

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "send_recv", "broadcast", "all_to_all")
ASSUMED = {  # bytes/s and seconds per call of one collective, where no probe measured them
    "cpu": (1e9, 1e-4),
    "cuda": (5e10, 2e-5),
}
PROBE, CORRECTIONS = "probe.json", "corrections.json"  # kept beside the bench records (snnfw tune)
GLOBAL_FIT_RECORDS = 3  # records on a device before the overhead and the two factors are fitted
STRATEGY_FIT_RECORDS = 2  # records of a strategy before its own factor is, and replaces them for it


@attrs.frozen
class Figure:
    """A number the model uses and where it came from."""

    value: float
    source: str


@attrs.frozen
class Link:
    """One collective kind on this cluster: its time is ``latency + bytes / bandwidth``."""

    bandwidth: Figure  # bytes/s
    latency: Figure  # s per call


@attrs.frozen
class Cluster:
    """What the model knows of the machines: the device, a host's cores and ranks, the collectives' links."""

    device: str  # "cpu" or the GPU's name
    device_type: str  # "cpu" or "cuda"
    cores: int
    local_ranks: int
    links: dict[str, Link]

    @classmethod
    def assumed(cls, device_type: str, device: str, cores: int, local_ranks: int) -> Cluster:
        bandwidth, latency = ASSUMED[device_type]
        source = f"assumed for {device_type} (no probe)"
        link = Link(Figure(bandwidth, source), Figure(latency, source))
        return cls(device, device_type, cores, local_ranks, dict.fromkeys(KINDS, link))

    @classmethod
    def here(cls, device_type: str, world_size: int) -> Cluster:
        """This host with assumed links, its ranks those of ``world_size`` on it (``LOCAL_WORLD_SIZE`` in a rank)."""
        import torch

        device = torch.cuda.get_device_name() if device_type == "cuda" else "cpu"
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        return cls.assumed(device_type, device, os.cpu_count() or 1, local)

    def oversubscription(self, threads: int) -> float:
        """How many times over a host's cores its ranks' threads ask for (1 on GPUs)."""
        return max(1.0, self.local_ranks * threads / self.cores) if self.device_type == "cpu" else 1.0

    def to_dict(self) -> dict:
        return {"device": self.device, "device_type": self.device_type, "cores": self.cores,
                "local_ranks": self.local_ranks,
                "links": {kind: attrs.asdict(link) for kind, link in self.links.items()}}

    @classmethod
    def from_dict(cls, data: dict) -> Cluster:
        links = {kind: Link(Figure(**link["bandwidth"]), Figure(**link["latency"])) for kind, link in data["links"].items()}
        return cls(data["device"], data["device_type"], data["cores"], data["local_ranks"], links)


def rank_threads(world_size: int) -> int:
    """A rank's threads as the launcher sets them (:mod:`snnfw.distributed.collectives`): ``OMP_NUM_THREADS``, else
    this host's cores shared by its ranks (``LOCAL_WORLD_SIZE`` in a rank, else all ``world_size``); the profile
    runs at it, so that compute and oversubscription are those of the run."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    return int(os.environ.get("OMP_NUM_THREADS", 0)) or max(1, (os.cpu_count() or 1) // local)


@attrs.frozen
class Traffic:
    """What one collective kind carries in a step on the busiest rank."""

    kind: str
    bytes: float
    calls: int


@attrs.frozen
class StepTerms:
    """A candidate's step before it meets a cluster: what the profile, the strategy and the dry run say."""

    strategy: str
    compute_ms: float  # forward and backward of the rank's samples, at the profile's threads
    optimizer_ms: float
    bubble: float
    threads: int  # a rank's threads, at which compute_ms was profiled
    traffic: tuple[Traffic, ...]
    sources: tuple[tuple[str, str], ...]  # (term, where it came from)
    dims: tuple[str, ...] = ()  # the mesh's dimensions, which key a learned factor (:func:`layout`)


@attrs.frozen
class Corrections:
    """What :func:`fit` learned on one device; the identity before any record."""

    device: str
    records: int = 0
    overhead_ms: float = 0.0
    compute: float = 1.0
    communication: float = 1.0
    strategies: dict[str, float] = attrs.Factory(dict)

    @property
    def source(self) -> str:
        return f"fitted from {self.records} bench record(s) on {self.device}" if self.records else "not learned (no records)"

    def factor(self, strategy: str | None, dims: tuple[str, ...] = ()) -> float | None:
        """The factor learned for ``strategy`` on a mesh of the dimensions ``dims``, else for ``strategy`` on any
        mesh, else None."""
        return self.strategies.get(layout(strategy, dims), self.strategies.get(strategy))

    def apply(self, compute_ms: float, communication_ms: float, strategy: str | None = None,
              dims: tuple[str, ...] = ()) -> float:
        """The corrected step time of uncorrected parts: the own factor of ``strategy`` (on ``dims``) where it has
        one, else the overhead and the two factors."""
        if (own := self.factor(strategy, dims)) is not None:
            return own * (compute_ms + communication_ms)
        return self.overhead_ms + self.compute * compute_ms + self.communication * communication_ms

    def to_dict(self) -> dict:
        return attrs.asdict(self)


@attrs.frozen
class Prediction:
    """A step's predicted milliseconds and its parts."""

    ms: float
    compute_ms: float  # compute, bubble and oversubscription included, with the optimizer
    communication_ms: float
    overhead_ms: float
    strategy_factor: float
    lines: tuple[str, ...]  # every figure and where it came from

    def parts(self) -> dict:
        """What a bench record keeps, to learn from later."""
        return {"ms": self.ms, "compute_ms": self.compute_ms, "communication_ms": self.communication_ms}


def layout(strategy: str | None, dims) -> str:
    """How :class:`Corrections` key a strategy on a mesh of the dimensions ``dims``: ``"mesh (dp_replicate x pp)"``.
    Its factor is learned apart from the strategy's on other meshes (a pipeline over data replicas waits otherwise
    than one alone)."""
    return f"{strategy} ({' x '.join(sorted(dims))})"


def _layout_of(plan: dict) -> tuple[str, dict | None]:
    """A record's strategy and mesh, a preset's as written by snnfw 0.2.0 (``fsdp2`` on ``{dp = 2}``) read as
    the composed mesh it is today (``mesh`` on ``{dp_shard = 2}``), so its factors key the same layout."""
    from snnfw.plan.presets import PRESETS, spelled_mesh

    strategy, mesh = plan["strategy"], plan.get("mesh")
    if strategy in PRESETS and mesh is not None:
        return COMPOSED, spelled_mesh(strategy, mesh)
    return strategy, mesh


def terms_of(strategy: str, estimate, cost, dims: tuple[str, ...] = ()) -> StepTerms:
    """A candidate's terms from its strategy's :class:`~snnfw.plan.estimate.Estimate` of ``cost`` (the profile):
    its bytes cross in the calls it counts, priced as all-reduces."""
    traffic = (Traffic("all_reduce", estimate.comm_bytes, max(round(estimate.calls), 1)),) if estimate.comm_bytes else ()
    share = estimate.parameter_bytes / cost.parameter_bytes if cost.parameter_bytes else 1.0
    return StepTerms(strategy, estimate.compute_ms, cost.optimizer_ms * share, estimate.bubble, cost.threads or 1, traffic,
                     (("compute", f"profile, {strategy}'s share"), ("optimizer", "profile, the rank's parameters"),
                      ("traffic", f"{strategy}'s estimate")), tuple(dims))


def predict(terms: StepTerms, cluster: Cluster, corrections: Corrections | None = None) -> Prediction:
    """The step time of ``terms`` on ``cluster``, corrected by what was learned there."""
    corrections = corrections or Corrections(cluster.device)
    over = cluster.oversubscription(terms.threads)
    compute = terms.compute_ms / (1.0 - terms.bubble) * over + terms.optimizer_ms * over
    communication = sum(_transfer_ms(t, cluster.links[t.kind]) for t in terms.traffic)
    own = corrections.factor(terms.strategy, terms.dims)
    ms = corrections.apply(compute, communication, terms.strategy, terms.dims)
    sources = dict(terms.sources)
    lines = [f"compute {terms.compute_ms:.2f} ms ({sources.get('compute', 'profile')}), bubble {terms.bubble:.0%}, "
             f"x{over:.2f} oversubscription ({cluster.local_ranks} rank(s) x {terms.threads} thread(s) on "
             f"{cluster.cores} core(s))",
             f"optimizer {terms.optimizer_ms:.2f} ms ({sources.get('optimizer', 'profile')})"]
    for t in terms.traffic:
        link = cluster.links[t.kind]
        lines.append(f"{t.kind}: {t.bytes:,.0f} bytes in {t.calls} call(s) ({sources.get('traffic', 'estimate')}) over "
                     f"{link.bandwidth.value:.3g} B/s ({link.bandwidth.source}), {link.latency.value * 1e6:.0f} us a "
                     f"call ({link.latency.source})")
    lines.append(f"{terms.strategy} x{own:.2f} on compute and communication ({corrections.source})" if own is not None
                 else f"overhead {corrections.overhead_ms:.2f} ms, compute x{corrections.compute:.2f}, communication "
                      f"x{corrections.communication:.2f} ({corrections.source})")
    return Prediction(ms, compute, communication, 0.0 if own is not None else corrections.overhead_ms, own or 1.0,
                      tuple(lines))


def _transfer_ms(traffic: Traffic, link: Link) -> float:
    return (traffic.calls * link.latency.value + traffic.bytes / link.bandwidth.value) * 1e3


def fit(records: list[dict], device: str) -> Corrections:
    """The corrections that bring the predictions of ``records`` (bench records of ``device`` carrying
    ``predicted`` parts) closest to their measured step times."""
    rows = [r for r in records if r.get("device") == device and r.get("predicted")]
    if len(rows) < GLOBAL_FIT_RECORDS:
        return Corrections(device)
    overhead, compute, communication = _least_squares(rows)
    ratios: dict[str, list[float]] = {}
    for r in rows:
        parts, (strategy, mesh) = r["predicted"], _layout_of(r["plan"])
        ratio = r["step_ms"] / (parts["compute_ms"] + parts["communication_ms"])
        for key in (strategy, *([layout(strategy, mesh)] if mesh is not None else [])):
            ratios.setdefault(key, []).append(ratio)
    strategies = {name: statistics.median(values) for name, values in ratios.items() if len(values) >= STRATEGY_FIT_RECORDS}
    return Corrections(device, len(rows), overhead, compute, communication, strategies)


def _least_squares(rows: list[dict]) -> tuple[float, float, float]:
    """(overhead, compute factor, communication factor), none negative, minimising the squared relative error:
    the best of the least-squares solutions over every subset of the three (a term left out counts 0, a factor
    left out 1 when its term cannot be told apart)."""
    import torch

    features = torch.tensor([[1.0, r["predicted"]["compute_ms"], r["predicted"]["communication_ms"]] for r in rows],
                            dtype=torch.float64)
    measured = torch.tensor([r["step_ms"] for r in rows], dtype=torch.float64)
    weights = 1.0 / measured
    best, best_error = (0.0, 1.0, 1.0), math.inf
    for kept in (s for n in (1, 2, 3) for s in itertools.combinations(range(3), n)):
        a = features[:, list(kept)] * weights[:, None]
        solution = torch.linalg.lstsq(a, (measured * weights)[:, None]).solution.flatten()
        if (solution < 0).any():
            continue
        coefficients = [0.0, 0.0, 0.0]
        for index, value in zip(kept, solution.tolist()):
            coefficients[index] = value
        error = float(((features @ torch.tensor(coefficients, dtype=torch.float64) - measured) * weights).square().sum())
        if error < best_error:
            best, best_error = tuple(coefficients), error
    return best


def read_records(path: Path) -> list[dict]:
    """The bench records of ``path`` (JSON lines), refusing in one line a file that is not one."""
    records = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8", errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise UserError(f"{path} line {number} is not a JSON record ({err.msg}); it is damaged: remove the line "
                            f"or point --results at snnfw bench's own file") from None
        if not isinstance(record, dict) or not {"step_ms", "device", "plan", "nproc"} <= record.keys():
            raise UserError(f"{path} line {number} is not an snnfw bench record (it lacks step_ms, device, plan or "
                            f"nproc); point --results at a file snnfw bench wrote")
        records.append(record)
    return records


REFIT, REPROBE = "snnfw tune refits it from the records", "snnfw tune probes the links again"  # after a damaged file


def read_kept(path: Path, remedy: str) -> dict:
    """The JSON object ``snnfw tune`` keeps at ``path`` (``probe.json``, ``corrections.json``), ``{}`` where there
    is none; a damaged file is refused in one line, ending in what deleting it does (``remedy``)."""
    if not Path(path).exists():
        return {}
    try:
        kept = json.loads(Path(path).read_text(encoding="utf-8"))
    except ValueError as err:
        raise UserError(f"{path} is not snnfw's {Path(path).stem} file ({err}); delete it, and {remedy}") from None
    if not isinstance(kept, dict):
        raise UserError(f"{path} is not snnfw's {Path(path).stem} file (it holds no JSON object); delete it, and "
                        f"{remedy}")
    return kept


def read_corrections(path: Path, device: str) -> Corrections:
    """The corrections stored at ``path`` for ``device``; the identity where none are."""
    stored = read_kept(path, REFIT)
    if device not in stored:
        return Corrections(device)
    try:
        return Corrections(**stored[device])
    except TypeError as err:
        raise UserError(f"{path} is not snnfw's corrections file ({err}); delete it, and {REFIT}") from None


def probe_key(device_type: str, world_size: int) -> str:
    """Where a probe of this host, device type and world size is kept in ``probe.json``."""
    import platform

    return f"{platform.node()}/{device_type}/{world_size}"


def stored_cluster(folder: Path, device_type: str, world_size: int) -> Cluster | None:
    """The probe ``folder`` keeps for this host, device type and world size; None where there is none."""
    path = Path(folder) / PROBE
    stored = read_kept(path, REPROBE)
    key = probe_key(device_type, world_size)
    try:
        return Cluster.from_dict(stored[key]) if key in stored else None
    except (KeyError, TypeError, AttributeError) as err:
        raise UserError(f"{path} is not snnfw's probe file ({type(err).__name__}: {err} in {key}); delete it, and "
                        f"{REPROBE}") from None


def learned(results: Path, device_type: str, world_size: int) -> tuple[Cluster, Corrections]:
    """What ``snnfw tune`` learned beside the bench records ``results``: the probe of this host, device type and
    world size (else the assumed links), and the corrections fitted from the records (else those stored, else
    none)."""
    results = Path(results)
    cluster = stored_cluster(results.parent, device_type, world_size) or Cluster.here(device_type, world_size)
    return cluster, learned_corrections(results, cluster.device)


def learned_corrections(results: Path, device: str) -> Corrections:
    """The corrections for ``device`` fitted from the bench records ``results``, else those stored beside them,
    else none."""
    results = Path(results)
    records = read_records(results) if results.exists() else []
    return fit(records, device) if records else read_corrections(results.parent / CORRECTIONS, device)


def write_corrections(path: Path, corrections: Corrections) -> None:
    """Stores ``corrections`` at ``path`` beside those of other devices."""
    stored = read_kept(path, REFIT)
    stored[corrections.device] = corrections.to_dict()
    Path(path).write_text(json.dumps(stored, indent=2) + "\n", encoding="utf-8")
