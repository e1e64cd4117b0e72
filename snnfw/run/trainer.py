"""apply: the parallelized model, its optimizer and one training step, whatever the strategy."""

from __future__ import annotations

import math
import time
import warnings

import attrs
import torch
import torch.distributed as dist

from snnfw.components.flops import training_flops_per_sample
from snnfw.components.metrics import SpikeCounter
from snnfw.components.ops import OpCounter
from snnfw.components.optim import build_scheduler
from snnfw.components.phases import PhaseTimes
from snnfw.components.precision import LossScale
from snnfw.components.records import StepResult
from snnfw.components.step import RunState
from snnfw.components.weights import load_weights
from snnfw.config import Config
from snnfw.data import batches as datalib
from snnfw.data.augment import Augmented, augment_options
from snnfw.distributed.collectives import all_reduce, broadcast_state, dp_coordinate, dp_group, set_timeouts
from snnfw.distributed.fault_tolerance import ReplicaGroup, check_model
from snnfw.distributed.grad_norm import clip_gradients, global_grad_norm, local_grad_squares, scale_gradients
from snnfw.distributed.materialize import FromRank0, Replayed, materialize, set_aside
from snnfw.distributed.running_stats import RunningStats
from snnfw.plan.prepare import Prepared, build_datasets
from snnfw.plugin.manager import Plugins


class Trainer:
    """Trains a parallelized model with microbatches, neuron resets and per-step metrics."""

    def __init__(self, config: Config, prepared: Prepared, plugins: Plugins, mesh, device, datasets: tuple | None = None,
                 weights: dict | None = None):
        started = time.perf_counter()
        self.config, self.plan, self.device = config, prepared.plan, device
        replayed = Replayed(prepared.recipe, weights) if prepared.builds_shards and prepared.recipe is not None else None
        self.run = RunState(PhaseTimes(config.log.phase_times, cuda=device.type == "cuda"),
                            LossScale(config.train.precision == "fp16", config.train.loss_scale),
                            initial=replayed.initial if replayed else None,
                            materialize=self._materialize if prepared.builds_shards else None)
        self.plugins = plugins = plugins.for_run(self.run)
        self.counter = SpikeCounter(prepared.model, prepared.analysis.neurons)
        self.ops = OpCounter(prepared.model, prepared.spec.time_steps, config.eval.energy_ac_pj, config.eval.energy_mac_pj)
        self.state_names = frozenset(prepared.model.state_dict())
        self.spec, self.num_classes = prepared.spec, prepared.spec.num_classes
        self.train_set, self.test_set = datasets or prepared.datasets or build_datasets(config, prepared.spec, plugins)
        registered = not datasets and config.data.builder is None
        self.bytes_per_token = plugins.datasets.get(config.data.name).bytes_per_token_of(config.data) if registered \
            else None
        for split, dataset in (("train", self.train_set), ("test", self.test_set)):
            datalib.check_samples(dataset, prepared.spec, split)
            if datasets:  # handed to the API; those built from data.builder are checked as they are built
                datalib.check_labels(dataset, self.num_classes, split)
        if config.data.augment:
            self.train_set = Augmented(self.train_set, config.data.augment, augment_options(config.data), config.train.seed,
                                       self.num_classes)
        self.dtype = config.train.torch_dtype
        model = prepared.model.to(self.dtype) if prepared.builds_shards else prepared.model.to(device, self.dtype)
        spec = prepared.spec
        self.flops_per_sample = training_flops_per_sample(model, spec.time_steps, spec.shape, plugins.reset_state)
        if prepared.given_instance and mesh is not None:
            broadcast_state(model)  # each rank built its own instance; all start from rank 0's
        if weights is not None:
            load_weights(model, weights)
        if prepared.builds_shards:  # parallelized on meta, then materialized
            names = set_aside(model)
            self._unmaterialized = (names, replayed or FromRank0(names))
        self.layout = self.plan.layout  # what the distributed primitives take, made once
        self.ft = ReplicaGroup(config) if config.parallel.fault_tolerance else None
        if self.ft:  # a replica group holds its whole replica alone: its gradient norm is its own
            self.layout = attrs.evolve(self.layout, mesh=(("dp_replicate", 1),))
        self.replica = self.ft.index if self.ft else dp_coordinate(self.layout, mesh)
        self.running_stats = RunningStats(model)  # from here on, only training steps update BatchNorm statistics
        plugins.transform_model(model, self.plan, self.example())
        if self.ft:  # the groups' gradients averaged by torchft's manager, over the groups present
            check_model(model)
            plugins.compile(model, self.plan)
            self.model = self.ft.wrap(model, lambda: self._state(model), lambda state: self._load(model, state))
        else:
            self.model = plugins.parallelize(model, self.plan, mesh)
        if mesh is not None:  # the process groups the strategy made (a composed mesh's rows) wait as long as the world's
            set_timeouts(config.parallel.timeout_s)
        if prepared.builds_shards:
            self._materialize(self.model)
            if replayed:
                replayed.release()
        if view := plugins.time_view(self.plan, mesh):  # this rank's model reads only these time steps
            self.train_set, self.test_set = (datalib.TimeView(d, *view) for d in (self.train_set, self.test_set))
        self.positions = plugins.sequence_view(self.plan, mesh)  # and only these positions of each sample's sequence
        if self.positions:
            self.train_set, self.test_set = (datalib.SequenceView(d, *self.positions)
                                             for d in (self.train_set, self.test_set))
        self.running_stats.bind(self.model, self.replica, self.plan.dp_size, dp_group(self.layout, mesh))
        self.counter.clear()  # spikes of the transforms' and strategies' own forward passes
        if self.plan.replicated_neuron_dims:
            self.counter.weigh_replicated(self.plan.size(self.plan.replicated_neuron_dims))
            self.ops.weigh_replicated(self.plan.size(self.plan.replicated_neuron_dims))
        self.optimizer = plugins.build_optimizer(self.model, self.plan, mesh)
        self.scheduler = build_scheduler(self.optimizer, config.train, plugins)
        self._batches, self._next_step = None, None
        self.last_step = None  # the step the last call of step trained
        if device.type == "cuda":  # the steps' peak, not the setup's (memopt's trials, a pipeline's split timing)
            torch.cuda.reset_peak_memory_stats(device)
        self.materialize_s = time.perf_counter() - started

    def _materialize(self, module: torch.nn.Module) -> None:
        """Storage on this rank's device for what the parallelized meta ``module`` holds, and its initial values
        (``hooks.run.materialize``): once, by whichever calls first."""
        if self._unmaterialized is None:
            return
        (names, values), self._unmaterialized = self._unmaterialized, None
        materialize(module, self.device, names, lambda: self.plugins.state_dict(module, None, self.plan)["model"], values)

    def example(self) -> torch.Tensor:
        """The frames of step 0's first microbatch of replica 0: the same on every rank."""
        first = datalib.microbatch_indices(0, self.plan, len(self.train_set), self.config.train.seed, replica=0)[0]
        return datalib.load(self.train_set, first, self.device, self.dtype)[0]

    def batches(self, step: int) -> list:
        """This replica's microbatches of ``step``, from a loader that runs ahead while steps follow on."""
        if step != self._next_step:
            cfg = self.config
            sampler = datalib.StepSampler(self.plan, len(self.train_set), cfg.train.seed, self.replica, step, cfg.train.steps,
                                          keys=bool(cfg.data.augment), repeats=cfg.data.repeated_augment)
            self._batches = datalib.step_batches(self.train_set, sampler, cfg.data.workers, self.device, self.dtype)
        self._next_step = step + 1
        return next(self._batches)

    def _state(self, model) -> dict:
        """What a replica group rejoining under ``parallel.fault_tolerance`` takes from a live peer."""
        return {"model": model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict()}

    def _load(self, model, state: dict) -> None:
        model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])

    def step(self, step: int) -> StepResult:
        """Trains optimizer step ``step``: its figures stay on the device (no host synchronisation unless fp16, which
        reads whether the step overflowed, as torch's GradScaler does).

        Under ``parallel.fault_tolerance`` the step begins with the groups' quorum, after which a group that was
        behind trains its peers' step (:attr:`last_step`), and a step that a group left before its end is trained
        again by the groups present."""
        while True:
            if self.ft:
                step = self.ft.begin(step)
            result = self._step(step)
            if self.ft is None or self.ft.committed:
                self.last_step = step
                return result

    def _step(self, step: int) -> StepResult:
        plan, config = self.plan, self.config
        self.model.train()
        with self.run.phases("data"):
            batches = self.batches(step)
        with self.run.phases("forward_backward"):
            self.running_stats.start()
            out = self.plugins.forward_backward(self.model, batches, plan)
        with self.run.phases("running_stats"):
            self.running_stats.apply()
        loss_scale = self.run.loss_scale
        lr, scale = self.optimizer.param_groups[0]["lr"], loss_scale.scale
        with self.run.phases("grad_norm"):
            squares = local_grad_squares(self.model, self.layout, self.device)  # this rank's share, reduced with the step's figures
            skip = False
            if loss_scale.enabled or config.train.clip_grad_norm is not None:
                norm = global_grad_norm(self.model, self.layout, squares) / scale  # the same on every rank
                if loss_scale.enabled:  # fp16 skips a step that overflowed, as torch's GradScaler does
                    skip = not bool(torch.isfinite(norm))
                    if not skip:
                        scale_gradients(self.model, 1.0 / scale)
                    loss_scale.update(not skip)
                if config.train.clip_grad_norm is not None and not skip:
                    clip_gradients(self.model, norm, config.train.clip_grad_norm)
        with self.run.phases("optimizer"):
            committed = self.ft.commit() if self.ft else True
            if not skip and committed:
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            with warnings.catch_warnings():  # the schedule follows the steps, skipped or not (not those trained again)
                warnings.filterwarnings("ignore", r"Detected call of `lr_scheduler\.step\(\)` before", UserWarning)
                if committed:
                    self.scheduler.step()
        spikes, elements = self.counter.take()
        extra = {**self.run.phases.take(), **self.plugins.step_metrics(plan)}
        figures = (out.loss * out.samples, out.correct, spikes, squares)
        ranks = 1 if self.ft else plan.world_size  # those the figures are added over (a replica group: itself)
        row = torch.stack([x if torch.is_tensor(x) else torch.tensor(float(x), dtype=torch.float64, device=self.device)
                           for x in figures]).to(self.device, torch.float64)

        def finish(totals: list[float]) -> dict[str, float]:
            loss, correct, spikes, squares, samples, elements, *extra_totals = totals
            samples = max(samples, 1.0)  # 0 only where collectives move nothing (the dry run's pipeline stages)
            return {
                "loss": loss / samples,
                "grad_norm": math.sqrt(squares) / scale,
                "train_acc": correct / samples,
                "spike_rate": spikes / max(elements, 1.0),
                **{key: total / ranks for key, total in zip(extra, extra_totals)},
            }

        values = {
            "epoch": (step + 1) * plan.global_batch / len(self.train_set),  # passes over the training set so far
            "lr": lr,
            **({"loss_scale": scale} if loss_scale.enabled else {}),
            **({"ft_groups": self.ft.participants()} if self.ft else {}),
        }
        return StepResult(values, row, [float(out.samples), float(elements), *extra.values()], finish,
                          ("loss", "grad_norm", "train_acc", "spike_rate", *extra))

    def layer_spike_rates(self) -> dict[str, float]:
        """Each neuron module's firing rate over the training steps so far, over all ranks (a collective)."""
        counts = self.counter.by_layer()
        totals = all_reduce([float(x) for pair in counts.values() for x in pair])
        return {name: totals[2 * i] / max(totals[2 * i + 1], 1.0) for i, name in enumerate(counts)}

    def _test_batches(self):
        """``(indices, labels, output)`` of each evaluation batch of this replica, ``indices`` empty for a
        forward pass that scores nothing.

        Replica ``r`` scores the ``r``-th of ``dp`` contiguous chunks of the test split (sizes differ by at
        most one) in batches of the replica batch; every replica runs as many forward passes, since sharded
        strategies gather in each.
        """
        self.model.eval()
        parts = 1 if self.ft else self.plan.dp_size  # a replica group scores the whole split, as one job
        chunks = torch.arange(len(self.test_set)).tensor_split(parts)
        mine, size = chunks[0 if self.ft else self.replica], self.plan.replica_batch
        rounds = -(-max(len(chunk) for chunk in chunks) // size)
        for start in range(0, rounds * size, size):
            indices = mine[start : start + size]
            frames, labels = datalib.load(self.test_set, indices if len(indices) else chunks[0][:1], self.device, self.dtype)
            yield indices, labels, self.plugins.evaluate(self.model, frames, labels, self.plan)

    @torch.no_grad()
    def evaluate(self, ops: bool = False) -> dict:
        """Loss, top-1 (and top-5) accuracy and firing rate on the test split, each sample scored once; with ``ops``
        the synaptic operations and energy (:mod:`snnfw.components.ops`): a sample's in ``eval_*`` keys, each layer's
        over the split in ``layer_ops``."""
        self.counter.clear()
        self.ops.counting(ops)
        loss = correct = top5 = samples = spikes = elements = 0.0
        for indices, _, out in self._test_batches():
            batch_spikes, batch_elements = self.counter.take(record=False)
            self.ops.take(keep=bool(len(indices)))
            batch_spikes = float(batch_spikes)
            if len(indices):  # else a pass that only keeps the collectives in step
                loss, correct, top5, samples = loss + out.loss * out.samples, correct + out.correct, top5 + out.top5, samples + out.samples
                spikes, elements = spikes + batch_spikes, elements + batch_elements
        loss, correct, top5, samples, spikes, elements = all_reduce([loss, correct, top5, samples, spikes, float(elements)])
        samples = max(samples, 1.0)
        result = {"eval_loss": loss / samples, "eval_acc": correct / samples, "eval_spike_rate": spikes / max(elements, 1.0)}
        if self.num_classes > 5:
            result["eval_acc5"] = top5 / samples
        if self.spec.vocab is not None:  # a language model: perplexity, and bits per byte of a text set
            result["eval_ppl"] = math.exp(min(result["eval_loss"], 700.0))
            if self.bytes_per_token:
                result["eval_bpb"] = result["eval_loss"] / math.log(2) / self.bytes_per_token
        if ops:
            counted = self.ops.totals(len(self.test_set))
            self.ops.counting(False)
            result.update({k: v for k, v in counted.items() if k != "layers"}, layer_ops=counted["layers"],
                          ops_samples=len(self.test_set), energy_ac_pj=self.ops.energy_ac_pj, energy_mac_pj=self.ops.energy_mac_pj)
        return result

    @torch.no_grad()
    def predict(self) -> list[dict]:
        """Every test sample's label, predicted class and time-averaged logits (a language model's: per position), in
        data order (a collective; the whole list on every rank)."""
        mine = []
        for indices, labels, out in self._test_batches():
            if len(indices) and out.logits is not None:  # pipeline ranks without the last stage score nothing
                mine += [{"index": i, "label": y, "predicted": row.argmax(-1).tolist(), "logits": row.tolist()}
                         for i, y, row in zip(indices.tolist(), labels.tolist(), out.logits)]
        self.counter.clear()
        parts = [mine]
        if dist.is_initialized():
            parts = [None] * dist.get_world_size()
            dist.all_gather_object(parts, mine)
        return sorted({row["index"]: row for part in parts for row in part}.values(), key=lambda row: row["index"])
