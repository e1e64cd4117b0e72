"""The ``snnfw`` command: ``plugins``, ``plan``, ``train``, ``submit``, ``bench``, ``export``, ``eval``, ``predict``,
``plot``, ``tokenize`` and ``generate``.

A user error (bad config, unknown name, impossible layout), or an error raised
in the user's own code inside a rank or in a third-party plugin's hook, exits
with status 2 and one message on stderr; ``--debug`` shows the traceback.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from pathlib import Path

from snnfw.errors import UserError, explain, said


def _cmd_plugins(args) -> int:
    from snnfw.plugin.manager import Plugins

    plugins = Plugins()
    rows = [
        {
            "name": p.name,
            "distribution": p.distribution,
            "version": p.version,
            "hooks": list(p.hooks),
            "registers": plugins.registered_names(p.name),
            "overridden_by": list(p.overridden_by),
            "error": p.error,
            "core": p.core,
        }
        for p in plugins.info()
    ]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for row in rows:
        names = "; ".join(f"{kind}: {', '.join(n)}" for kind, n in row["registers"].items())
        where = ", in the core" if row["core"] else ""
        print(f"{row['name']} ({row['distribution']} {row['version']}{where})".rstrip())
        if row["error"]:
            print(f"    not loaded: failed to import: {row['error']}")
            continue
        if row["overridden_by"]:
            print(f"    unloaded: overridden by {', '.join(row['overridden_by'])}")
            continue
        print(f"    hooks: {', '.join(h.removeprefix('snnfw_') for h in row['hooks'])}")
        if names:
            print(f"    registers {names}")
    return 0


def _cmd_plan(args) -> int:
    from snnfw.config import load_config
    from snnfw.errors import ConfigError
    from snnfw.plan.prepare import prepare
    from snnfw.plugin.manager import Plugins

    if args.world_size < 1:
        raise ConfigError(f"--world-size counts the ranks, 1 or more; got {args.world_size}")
    config = load_config(args.config, args.overrides)
    plugins = Plugins()
    if args.measure is not None:
        return _measure(args, config, plugins)
    if args.dry_run or args.device_memory:
        return _dry_run(args, config, plugins)
    prepared = prepare(config, args.world_size, plugins)
    plan, analysis = prepared.plan, prepared.analysis
    if args.json:
        print(json.dumps({"plan": plan.to_dict(), "config": config.to_dict()}, indent=2))
        return 0
    mesh = " x ".join(f"{d}={n}" for d, n in plan.mesh)
    print(f"strategy {plan.name} on {plan.world_size} rank(s), {plan.device_type}/{plan.backend}, mesh {mesh}")
    model = analysis.family if analysis.own else f"{config.model.family}/{config.model.flavor}"
    print(f"model {model}: {analysis.parameters:,} parameters, {len(analysis.neurons)} neuron modules")
    for key, names in (("blocks", analysis.blocks), ("stage_units", analysis.stage_units),
                       ("tp_plan", [f"{name}={style}" for name, style in analysis.tp_plan])):
        origin = "inferred" if key in analysis.inferred else "declared"
        print(f"  {key} ({origin}): {', '.join(names) or 'none'}")
    print(f"batch: global {plan.global_batch}, per replica {plan.replica_batch}, microbatch {plan.microbatch_size} x {plan.microbatches}")
    print("why:")
    for line in plan.rationale:
        print(f"  - {line}")
    return 0


def _dry_run(args, config, plugins) -> int:
    """``snnfw plan --dry-run``: what each representative rank of the job holds, measured under a fake process group."""
    from snnfw.tools.dry_run import dry_run, parse_bytes, report

    memory = parse_bytes(args.device_memory) if args.device_memory else None
    if config.parallel.strategy == "auto":
        return _dry_run_candidates(args, config, plugins, memory)
    plan, footprints = dry_run(config, args.world_size, plugins)
    print("\n".join(report(plan, footprints, memory)))
    return 0


def _dry_run_candidates(args, config, plugins, memory: int | None) -> int:
    """``--dry-run`` with strategy auto: every runnable candidate dry-run, ranked by what its ranks hold."""
    from snnfw.config import load_config
    from snnfw.errors import ConfigError
    from snnfw.plan.prepare import auto_candidates
    from snnfw.tools.dry_run import dry_run, largest_microbatch

    prefer, measured, skipped = config.parallel.prefer or "speed", [], {}
    # the cluster's ranks are not this machine's: the dry run, not this machine's memory, says what fits
    for candidate in auto_candidates(config, args.world_size, plugins, device_memory=memory or math.inf):
        try:
            chosen = load_config(args.config, [*args.overrides, *candidate.overrides()])
            plan, footprints = dry_run(chosen, args.world_size, plugins)
        except ConfigError as err:  # a candidate the model cannot take (units that do not compose a pipeline)
            name = " ".join([candidate.name, *(str(value) for _, value in candidate.settings)])
            skipped.setdefault(str(err), []).append(name)
            continue
        largest = max(footprints, key=lambda item: item[1].total)[1]
        batch = largest_microbatch(largest, plan.microbatch_size, memory) * plan.microbatches if memory else 0
        measured.append((candidate, plan, largest, batch))
    order = {"memory": lambda m: m[2].total, "capacity": lambda m: -m[3] * m[1].dp_size}.get(prefer)
    ranked = sorted(measured, key=order) if order else measured  # speed: the estimates' order (a dry run times nothing)
    print(f"dry run of auto's candidates on {args.world_size} rank(s), prefer {prefer}; the rank holding most in each:")
    for candidate, plan, largest, batch in ranked:
        mesh = " x ".join(f"{d}={n}" for d, n in plan.mesh)
        fits = (f"; fits {args.device_memory}: {'yes' if largest.total <= memory else 'no'}, largest batch "
                f"{batch} a replica ({batch * plan.dp_size} global)") if memory else ""
        print(f"  {candidate.assignments} ({mesh}): holds {largest.total:,} bytes, its collectives carry "
              f"{largest.communication:,} a step{fits}")
    for reason, names in skipped.items():
        print(f"  not measured: {', '.join(names)}: {reason}")
    if ranked:
        print(f"by the dry run, prefer {prefer} picks {ranked[0][0].assignments}")
    return 0


def _measure(args, config, plugins) -> int:
    """``snnfw plan --measure K``: time the top K auto candidates for real and name the fastest."""
    from snnfw.errors import ConfigError
    from snnfw.plan.auto import AUTO
    from snnfw.plan.prepare import auto_candidates
    from snnfw.tools.measure import measure_top

    if config.parallel.strategy != AUTO:
        raise ConfigError("--measure compares auto's candidates; set parallel.strategy = \"auto\"")
    if args.measure < 1:
        raise ConfigError(f"--measure K times the top K candidates, K 1 or more; got {args.measure}")
    ranked = auto_candidates(config, args.world_size, plugins)
    print(f"timing the top {min(args.measure, len(ranked))} candidates, a few steps each in a temporary folder (their "
          f"'done' lines score {args.world_size} test samples: only the step times count)", file=sys.stderr, flush=True)
    timed = measure_top(args.config, args.overrides, args.world_size, ranked[: args.measure])
    for candidate, step_ms in timed:
        settings = f" {dict(candidate.settings)}" if candidate.settings else ""
        print(f"{candidate.name} {candidate.mesh}{settings}: {step_ms:.1f} ms/step measured")
    if not timed:
        raise ConfigError(f"none of the top {args.measure} candidates ran; see the errors above")
    print(f"fastest measured: {timed[0][0].name}; set {timed[0][0].assignments}")
    return 0


def _cmd_train(args) -> int:
    import contextlib

    from snnfw import rundir
    from snnfw.config import load_config
    from snnfw.errors import ConfigError
    from snnfw.plan import planfile
    from snnfw.plan.prepare import build_datasets, prepare
    from snnfw.plugin.manager import Plugins
    from snnfw.tools.launch import check_wandb_login, launch

    if args.nnodes > 1 and not (args.rdzv_endpoint and args.run_dir):
        raise ConfigError("--nnodes 2 or more needs --rdzv-endpoint HOST:PORT (node rank 0's host) and a shared --run-dir")
    if not 0 <= args.node_rank < args.nnodes:
        raise ConfigError(f"--node-rank must be from 0 to {args.nnodes - 1}, got {args.node_rank}")
    if args.resume and not args.run_dir:
        raise ConfigError("--resume continues the run in --run-dir; name it")
    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts counts restarts after a rank dies: 0 or more, got {args.max_restarts}")
    if args.resume and args.overwrite:
        raise ConfigError("--resume continues the run in --run-dir and --overwrite replaces it; pass one of them")
    config = load_config(args.config, args.overrides)
    if config.parallel.fault_tolerance is not None:
        raise ConfigError("parallel.fault_tolerance runs each replica group as a process of its own beside a lighthouse, "
                          "not under snnfw train's launcher: start torchft_lighthouse, then each group with "
                          "REPLICA_GROUP_ID=k python -m snnfw.train CONFIG --run-dir DIR (docs/fault_tolerance.md)")
    check_wandb_login(config)
    plugins = Plugins()
    # refuse a bad config before starting any process
    prepared = prepare(config, args.nproc * args.nnodes, plugins, local_ranks=args.nproc)
    if prepared.datasets is None:  # those counting epochs were built and checked
        build_datasets(prepared.plan.config, prepared.spec, plugins)
    model = re.sub(r"\W+", "_", prepared.analysis.family.rpartition("/")[2]).strip("_")
    run_dir = Path(args.run_dir or f"runs/{model}-{config.parallel.strategy}-{time.strftime('%Y%m%d-%H%M%S')}")
    rundir.check_run_dir(run_dir, args.resume, args.overwrite)
    owner = rundir.locked(run_dir) if args.node_rank == 0 else contextlib.nullcontext()  # node 0 holds the shared one
    with owner:
        if config.checkpoint.every and not args.overwrite:  # --overwrite replaces the folder in rank 0
            rundir.check_checkpoints_writable(run_dir, config.checkpoint.every)
        plan = run_dir / rundir.PLAN
        if args.node_rank == 0:  # every node's ranks run node 0's plan, written before its rendezvous opens
            planfile.write(plan, prepared.plan, plugins, planfile.config_digest(args.config, args.overrides))
        return launch(
            args.config, args.nproc, run_dir, args.overrides, config.parallel.timeout_s, nnodes=args.nnodes,
            node_rank=args.node_rank, rdzv_endpoint=args.rdzv_endpoint, max_restarts=args.max_restarts,
            resume=args.resume, extra=["--overwrite"] if args.overwrite else [], plan=plan, debug=args.debug,
            save_on_signals=config.checkpoint.save_on_signals, grace_s=config.checkpoint.grace_s,
        )


def _cmd_submit(args) -> int:
    from snnfw.tools.submit import submit

    run_dir = Path(args.run_dir or f"runs/{Path(args.config).stem}-{time.strftime('%Y%m%d-%H%M%S')}")
    return submit(args.config, run_dir, args.overrides, args.nodes, args.gpus_per_node, args.time, args.partition,
                  args.dry)


def _cmd_bench(args) -> int:
    from snnfw.errors import ConfigError
    from snnfw.tools.bench import bench
    from snnfw.tools.report import report

    if args.report:
        into = Path(args.into) if args.into else None
        return report(Path(args.results), Path(args.chart or Path(args.results).with_suffix(".png")), into)
    if args.config is None:
        raise ConfigError("snnfw bench needs a CONFIG (or --report to summarise a results file)")
    return bench(
        args.config, args.nproc, args.overrides, args.warmup, args.steps, Path(args.results), args.regime, args.label,
        args.baseline,
    )


def _cmd_tune(args) -> int:
    from snnfw.tools.tune import tune

    return tune(args.config, args.world_size, args.overrides, args.budget_s, args.results and Path(args.results),
                Path(args.out), args.measure, probe_now=not args.no_probe)


def _cmd_export(args) -> int:
    from snnfw.components.export import export
    from snnfw.errors import ConfigError

    if args.format == "nir":
        return _export_nir(args)
    for given, flag in ((args.config, "--config"), (args.overrides, "--set")):
        if given:
            raise ConfigError(f"{flag} changes the config that builds the network for --format nir; a state dict "
                              f"is exported without one: remove {flag}")
    print(export(args.source, args.out).line())
    return 0


def _export_nir(args) -> int:
    """``snnfw export --format nir``: the network of the run's own config (or ``--config``), with ``--set``, and the
    weights SOURCE names, as a NIR graph, checked against the model on the first test samples and inputs on which
    every layer fires. One process, whatever strategy trained it: nothing is planned."""
    import torch

    from snnfw.components import export, extras, nir_export
    from snnfw.components.weights import load_weights, read_weights
    from snnfw.config import load_config
    from snnfw.data import batches as datalib
    from snnfw.plan.prepare import build_datasets, model_alone
    from snnfw.plugin.manager import Plugins
    from snnfw.rundir import check_writable

    extras.require("nir", "--format nir", "nir")
    weights = export.weights_of(args.source)[0]  # a run without weights refused before anything is built
    config = load_config(args.config, args.overrides) if args.config else export.run_config(weights, args.overrides)
    plugins = Plugins()
    config, model, spec = model_alone(config, plugins)
    nir_export.layers(model)  # a layer NIR cannot express, refused before the weights are read
    out = Path(args.out)
    check_writable(out, "--out")
    load_weights(model, read_weights(weights))
    test_set = build_datasets(config, spec, plugins)[1]
    frames, _ = datalib.load(test_set, torch.arange(min(4, len(test_set))), torch.device("cpu"))
    graph, checked = nir_export.export(model, frames, out)
    print(f"exported {weights} as NIR: {len(graph.nodes)} nodes; {checked.line()} -> {out}")
    return 0


def _cmd_eval(args) -> int:
    """``snnfw eval`` and ``snnfw predict``: score weights under any strategy on N local ranks."""
    from snnfw import rundir
    from snnfw.components.weights import load_weights, read_weights
    from snnfw.config import for_evaluation, load_config
    from snnfw.plan import planfile
    from snnfw.plan.prepare import prepare
    from snnfw.plugin.manager import Plugins
    from snnfw.run.loop import check_predictions_file
    from snnfw.tools.launch import launch

    config, plugins = for_evaluation(load_config(args.config, args.overrides)), Plugins()
    prepared = prepare(config, args.nproc, plugins, local_ranks=args.nproc)  # refuse a bad config before any process
    weights = _scored_weights(Path(args.weights))
    load_weights(prepared.model, read_weights(weights))  # and weights that are not there or do not fit
    predict = getattr(args, "out", None)
    check_predictions_file(predict)
    run_dir = Path(args.run_dir) if args.run_dir else weights.parent if weights.is_file() else weights.parent.parent
    extra = ["--evaluate", str(weights)] + (["--predict", predict] if predict else [])
    with rundir.locked(run_dir):  # not a folder a run in progress writes, nor a file or a place that cannot be written
        plan = run_dir / rundir.EVAL_PLAN
        planfile.write(plan, prepared.plan, plugins, planfile.config_digest(args.config, args.overrides))
        return launch(args.config, args.nproc, run_dir, args.overrides, config.parallel.timeout_s, extra=extra,
                      plan=plan, debug=args.debug)


def _scored_weights(weights: Path) -> Path:
    """The file or checkpoint folder ``--weights`` names: itself, or a run directory's newest weights, its newest
    complete checkpoint unless its final_model.pt is newer (:func:`snnfw.components.export.weights_of`, as
    ``snnfw export`` reads it)."""
    from snnfw.components import export

    return export.weights_of(weights)[0]


def _cmd_plot(args) -> int:
    from snnfw.tools.plot import plot

    out = args.out or str(Path(args.run_dirs[0]) / "run.png" if len(args.run_dirs) == 1 else "runs.png")
    print(f"wrote {plot(args.run_dirs, out)}")
    return 0


def _cmd_tokenize(args) -> int:
    from snnfw.tools.tokenize import tokenize

    print(tokenize(args.sources, args.out, args.tokenizer, args.val_share))
    return 0


def _cmd_generate(args) -> int:
    from snnfw.tools.generate import generate

    print(generate(args.source, args.prompt, args.tokens, args.temperature, args.top_k, args.seed))
    return 0


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="snnfw", description="Distributed training of multi-step spiking neural networks.")
    top.add_argument("--debug", action="store_true", help="show tracebacks of user errors")
    sub = top.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plugins", help="list loaded plugins, their hooks and the names they register")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=_cmd_plugins)

    overrides = dict(dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    p = sub.add_parser("plan", help="show the plan for a config and world size, starting no process")
    p.add_argument("config")
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--measure", type=int, metavar="K", help="with strategy auto: run a few steps of the top K candidates")
    p.add_argument("--dry-run", action="store_true",
                   help="apply the strategy at --world-size under a fake process group; print each rank's memory")
    p.add_argument("--device-memory", metavar="SIZE", help="with --dry-run: mark what fits a device of SIZE (80GB)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--set", **overrides)
    p.set_defaults(run=_cmd_plan)

    p = sub.add_parser("train", help="train on N local ranks (gloo on CPU, NCCL on GPU)")
    p.add_argument("config")
    p.add_argument("--nproc", type=int, default=1, help="ranks to start on this node (default 1)")
    p.add_argument("--run-dir", help="where metrics.jsonl and summary.json go (default runs/FAMILY-STRATEGY-TIME)")
    p.add_argument("--set", **overrides)
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --run-dir")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier run's files in --run-dir")
    p.add_argument("--max-restarts", type=int, default=0, help="restart the group this often when a rank dies")
    p.add_argument("--nnodes", type=int, default=1, help="nodes in the job, each running one snnfw train")
    p.add_argument("--node-rank", type=int, default=0, help="this node's rank; node 0 hosts the rendezvous")
    p.add_argument("--rdzv-endpoint", metavar="HOST:PORT", help="where the nodes meet (c10d rendezvous)")
    p.set_defaults(run=_cmd_train)

    p = sub.add_parser("submit", help="write a SLURM batch script into the run directory and submit it with sbatch")
    p.add_argument("config")
    p.add_argument("--nodes", type=int, required=True, help="nodes of the job, one torchrun each")
    p.add_argument("--gpus-per-node", type=int, required=True, help="GPUs of each node, one rank each")
    p.add_argument("--time", required=True, metavar="HH:MM:SS", help="the job's time limit")
    p.add_argument("--partition", help="the SLURM partition (default: the cluster's)")
    p.add_argument("--run-dir", help="where the script and the run go (default runs/CONFIG-TIME)")
    p.add_argument("--dry", action="store_true", help="write and print the script without submitting it")
    p.add_argument("--set", **overrides)
    p.set_defaults(run=_cmd_submit)

    p = sub.add_parser("bench", help="time a config: warm-up, timed steps, one JSON record appended")
    p.add_argument("config", nargs="?")
    p.add_argument("--nproc", type=int, default=1, help="ranks to start (default 1)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--regime", default="throughput", help="throughput, latency or memory (a label for the record)")
    p.add_argument("--label", help="free text stored with the record and part of its comparison key")
    p.add_argument("--results", default="benchmark/results/bench.jsonl")
    p.add_argument("--baseline", action="store_true", help="time the plain PyTorch loop (one process, or DDP) instead")
    p.add_argument("--report", action="store_true", help="print a table and write a chart of the latest records")
    p.add_argument("--chart", help="where --report writes its PNG (default: beside the results file)")
    p.add_argument("--into", metavar="FILE", help="with --report: also write the table between FILE's "
                   "<!-- bench-table --> and <!-- /bench-table --> lines (docs/benchmarks.md's results)")
    p.add_argument("--set", **overrides)
    p.set_defaults(run=_cmd_bench)

    p = sub.add_parser("tune", help="predict every candidate plan's step time, measure the best, write the fastest")
    p.add_argument("config")
    p.add_argument("--world-size", type=int, required=True, help="ranks to tune for (measured here when this host runs them)")
    p.add_argument("--budget-s", type=float, default=300.0, help="seconds for the whole search (default 300)")
    p.add_argument("--measure", type=int, default=3, help="candidates to measure, best predicted first (default 3; 0: none)")
    p.add_argument("--results", help="bench records to learn from and add to (default: bench.jsonl beside --out); "
                   "probe.json and corrections.json live beside it")
    p.add_argument("--out", default="tuned.toml", help="where the winner's config is written (default tuned.toml)")
    p.add_argument("--no-probe", action="store_true", help="assume the links' figures rather than probe them")
    p.add_argument("--set", **overrides)
    p.set_defaults(run=_cmd_tune)

    p = sub.add_parser("export", help="write a run's model as a plain state dict (torch.save or .safetensors) or NIR")
    p.add_argument("source", metavar="SOURCE",
                   help="a run directory (its newest complete checkpoint, or its final_model.pt where that is "
                        "newer), a checkpoints/step-K folder, or a weights file (best_model.pt, say)")
    p.add_argument("--out", required=True, metavar="FILE", help="where to write; a .safetensors name writes that format")
    p.add_argument("--format", choices=("state_dict", "nir"), default="state_dict",
                   help="nir: the network as a Neuromorphic Intermediate Representation graph, in one process "
                        "whatever strategy trained it")
    p.add_argument("--config", help="with --format nir: the config that builds the network (default: the one the "
                                    "run recorded, in its summary.json or plan.json)")
    p.add_argument("--set", **overrides)  # with --format nir
    p.set_defaults(run=_cmd_export)

    for name, text in (("eval", "score weights on the test split under the config's strategy (eval.json in --run-dir)"),
                       ("predict", "write each test sample's label, predicted class and logits as JSON lines")):
        p = sub.add_parser(name, help=text)
        p.add_argument("config")
        p.add_argument("--weights", required=True, metavar="PATH",
                       help="a run directory (its newest checkpoint, or final_model.pt where newer), a checkpoint, "
                            "or a .pt file")
        p.add_argument("--nproc", type=int, default=1, help="ranks to start (default 1)")
        p.add_argument("--run-dir", help="where eval.json goes (default: beside the weights, in their run directory)")
        p.add_argument("--set", **overrides)
        if name == "predict":
            p.add_argument("--out", required=True, metavar="FILE.jsonl")
        p.set_defaults(run=_cmd_eval)

    p = sub.add_parser("plot", help="draw the runs' loss, accuracy, test accuracy, lr, firing rate and step time")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    p.add_argument("--out", help="the PNG to write (default RUN_DIR/run.png for one run, runs.png for several)")
    p.set_defaults(run=_cmd_plot)

    p = sub.add_parser("tokenize", help="write a token folder (train.bin, val.bin, meta.json) for data set "
                                        "token_memmap from text or JSONL files")
    p.add_argument("sources", nargs="+", metavar="SRC", help="text files (a document each) or .jsonl files (a "
                                                             "document a line, its \"text\" field)")
    p.add_argument("--out", required=True, metavar="DIR", help="the folder to write (data.root)")
    p.add_argument("--tokenizer", default="bytes", metavar="bytes|bpe:V|TOKENIZER.json",
                   help="UTF-8 bytes (default), a byte-level BPE of V tokens trained on SRC, or a saved tokenizers "
                        "tokenizer.json (both need: pip install 'snnfw[lm]')")
    p.add_argument("--val-share", type=float, default=0.01, help="the share of the ids held out as val.bin (0.01)")
    p.set_defaults(run=_cmd_tokenize)

    p = sub.add_parser("generate", help="sample text from a trained language model run, in one process")
    p.add_argument("source", metavar="RUN", help="a run directory (its final_model.pt, else best_model.pt), or a "
                                              "weights file in one")
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--tokens", type=int, default=64, help="tokens to sample (default 64)")
    p.add_argument("--temperature", type=float, default=1.0, help="divides the logits; 0 takes the likeliest (1.0)")
    p.add_argument("--top-k", type=int, default=None, help="sample among the K likeliest tokens only")
    p.add_argument("--seed", type=int, default=0, help="the sampling seed (default 0)")
    p.set_defaults(run=_cmd_generate)
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.run(args)
    except UserError as err:
        if args.debug:
            raise
        print(f"snnfw: error: {explain(err)}", file=sys.stderr)
        return 2
    except Exception as err:
        from snnfw.plugin.manager import plugin_hook

        if args.debug or not (where := plugin_hook(err)):
            raise
        print(f"snnfw: error: {where}: {type(err).__name__}: {said(err)}; fix or uninstall the plugin (snnfw --debug "
              "shows the traceback)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
