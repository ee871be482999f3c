"""The ``equiopt`` command: demo, data, train, compare, plot, roles, coord-check, plan, bench."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


def _load_model(spec: str):
    """``family[:size]`` built on the meta device (nothing allocated), or ``module:attr``."""
    from . import models

    family, _, size = spec.partition(":")
    if family in models.FAMILIES:
        return models.build(family, size or "tiny", device="meta")
    if family == "torchtitan":
        try:
            from .integrations.torchtitan import build_model
        except ImportError as err:
            raise SystemExit(f"equiopt: {spec!r} needs torchtitan (pip install 'equiopt[titan]'): {err}") from None
        try:
            return build_model(size, device="meta")
        except ValueError as err:
            raise SystemExit(f"equiopt: {err}") from None
    if ":" in spec:
        import importlib

        module, _, attr = spec.partition(":")
        obj = getattr(importlib.import_module(module), attr)
        return obj() if callable(obj) else obj
    raise SystemExit(
        f"unknown model {spec!r}: use one of {', '.join(models.FAMILIES)} (optionally :SIZE), "
        "torchtitan:MODEL[:FLAVOR], or module:attribute"
    )


def _check_replicas(model) -> int:
    """``equiopt roles --check-replicas``: :func:`equiopt.diagnostics.check_replicas` on every rank
    of a ``torchrun`` launch; 1 when something differs."""
    import os

    import torch.distributed as dist

    from .diagnostics import check_replicas

    if not dist.is_initialized():
        if "RANK" not in os.environ:
            raise SystemExit("equiopt roles --check-replicas compares ranks: launch it with torchrun")
        dist.init_process_group("nccl" if any(p.is_cuda for p in model.parameters()) else "gloo")
    if any(p.device.type == "meta" for p in model.parameters()):
        raise SystemExit(
            "equiopt roles --check-replicas needs real weights: give a module:attribute that builds the model "
            "(parallelised as you train it), not a FAMILY:SIZE, which is built on the meta device"
        )
    differ = check_replicas(model)
    if dist.get_rank() == 0:
        if not differ:
            print("replicas: every replicated parameter and gradient equal on every rank", flush=True)
        for name in differ:
            print(f"replicas: {name} differs across ranks", flush=True)
    # every rank done with the group before it goes: a process leaving with gloo's threads
    # still running aborts ("terminate called without an active exception")
    dist.barrier()
    dist.destroy_process_group()
    return 1 if differ else 0


def parse_sets(items: list[str]) -> dict:
    """``section.field=value`` overrides; values are parsed as TOML scalars when they can be."""
    from .train.config import tomllib

    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set {item!r}: expected section.field=value")
        try:
            out[key] = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            out[key] = value
    return out


def _run_configs(
    paths: list[str], sets: dict, resume: bool, force: bool = True, resume_from: str | None = None
) -> list[str]:
    from .roles import RoleInferenceError
    from .train import CheckpointError, load_config, train
    from .train.config import ConfigError

    out_dirs = []
    for path in paths:
        try:
            cfg = load_config(path, sets)
        except ConfigError as err:
            raise SystemExit(f"equiopt: {err}") from None
        done = cfg.out_path / "log.jsonl"
        if not force and done.exists() and '"status": "done"' in done.read_text().splitlines()[-1]:
            print(f"{cfg.out_path}: already done, skipped (use --force to retrain)")
        else:
            try:
                train(cfg, resume=resume, resume_from=resume_from)
            except (ConfigError, RoleInferenceError, CheckpointError) as err:
                raise SystemExit(f"equiopt: {path}: {err}") from None
        out_dirs.append(str(cfg.out_path))
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # every rank done with the group before it goes (see check_replicas above)
        dist.destroy_process_group()
    return out_dirs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="equiopt", description="Symmetry-compatible optimizers for LM pre-training.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo", help="prepare data offline, train a small Qwen3-style model with two recipes, compare"
    )
    demo.add_argument("--quick", action="store_true", help="the optimizer-only demo on a synthetic problem (a minute)")
    demo.add_argument("--steps", type=int, default=None)
    demo.add_argument("--out", default="runs/demo")
    demo.add_argument(
        "--seed", type=int, default=None, help="default: 10 (an evaluation seed of the held-out study), 0 with --quick"
    )
    sub.add_parser(
        "data",
        help="prepare token shards: equiopt data prepare --corpus poetry --tokenizer gpt2 --out DIR",
        add_help=False,
    )
    tr = sub.add_parser("train", help="train from a TOML config (single process or under torchrun)")
    tr.add_argument("config")
    resume = tr.add_mutually_exclusive_group()
    resume.add_argument(
        "--resume",
        action="store_true",
        help="continue from the run's newest intact checkpoint (a damaged newer one is skipped with a warning)",
    )
    resume.add_argument(
        "--resume-from",
        default=None,
        metavar="DIR",
        help="continue from exactly this checkpoint directory (e.g. RUN/checkpoints/step_00001000); "
        "fails if it is damaged, naming the intact ones",
    )
    tr.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE", help="override a config field")
    cmp = sub.add_parser("compare", help="train several configs (or seeds) and print the final-loss table and figures")
    cmp.add_argument("configs", nargs="*")
    cmp.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    cmp.add_argument(
        "--seeds",
        type=_seed_list,
        default=None,
        metavar="N|S1,S2,...",
        help="evaluation seeds: N runs seeds 0..N-1 (default: the config's own seed)",
    )
    cmp.add_argument(
        "--protocol",
        default=None,
        metavar="PROTOCOL.toml",
        help="run the study a protocol file fixes (configs, grid, tuning and evaluation seeds, claims); "
        "the report records the file's SHA-256",
    )
    cmp.add_argument(
        "--allow-seed-overlap",
        action="store_true",
        help="accept evaluation seeds that also tuned the lrs (refused otherwise; the report says so first)",
    )
    cmp.add_argument("--force", action="store_true", help="retrain runs that are already done")
    cmp.add_argument("--out", default=None, help="directory for the figures")
    cmp.add_argument(
        "--baseline",
        default=None,
        metavar="NAME",
        help="run name (or config path) of the baseline: adds paired per-seed differences with mean, "
        "95%% Student-t CI and sign counts",
    )
    cmp.add_argument("--metric", default="val/loss", help="logged key compared (default %(default)s)")
    cmp.add_argument(
        "--sweep-lr",
        default=None,
        metavar="M1,M2,...",
        help="tune each config's lrs on this grid of multipliers (resumable; seeds paired), then "
        "compare best against best (needs --baseline)",
    )
    cmp.add_argument(
        "--tune-seeds",
        type=_seed_list,
        default=None,
        metavar="K|S1,S2,...",
        help="with --sweep-lr: the grid's seeds (K: seeds 0..K-1), disjoint from --seeds; the evaluation "
        "seeds then run at each arm's chosen multiplier",
    )
    cmp.add_argument(
        "--sweep-roles", default=None, metavar="ROLE,...", help="roles whose lr the sweep multiplies (default: all)"
    )
    cmp.add_argument("--report", default=None, metavar="PATH.md", help="write a markdown report (and figures) here")
    cmp.add_argument(
        "--jobs",
        type=_positive_int,
        default=1,
        metavar="N",
        help="with a sweep: train N runs at once, each in its own process (fills a GPU that one small model "
        "leaves idle; the runs and the report are the same as with 1, the default)",
    )
    sub.add_parser(
        "plot", help="draw the paper's figures from run directories: equiopt plot RUN... [--out DIR]", add_help=False
    )
    sub.add_parser("table", help="final validation losses of run directories, mean and std over seeds", add_help=False)
    roles = sub.add_parser("roles", help="print the role table of a model: name, shape, role, work shape, rule, lr")
    roles.add_argument(
        "model",
        help="FAMILY[:SIZE] of equiopt.models (e.g. qwen3:paper, olmoe:tiny), a torchtitan model "
        "torchtitan:MODEL[:FLAVOR] (e.g. torchtitan:llama3:8B, torchtitan:deepseek_v3:16B), "
        "or module:attribute of a callable returning an nn.Module",
    )
    roles.add_argument(
        "--recipe", default="equiopt:default", help="recipe whose rule and lr are shown (default %(default)s)"
    )
    roles.add_argument("--no-reasons", action="store_true", help="omit the reason column")
    roles.add_argument(
        "--check-replicas",
        action="store_true",
        help="under torchrun (a module:attribute model with real weights): also compare every parameter and "
        "gradient that should be equal on every rank, name those that differ, and exit 1 if any does",
    )
    coord = sub.add_parser(
        "coord-check",
        help="train a few steps at several widths and show whether each role's activation and update RMS "
        "stay flat in width (muP-style)",
    )
    coord.add_argument("model", help="FAMILY[:SIZE] of equiopt.models (default size small), e.g. qwen3:small")
    coord.add_argument(
        "--recipe", default="equiopt:default", help="recipe, the same lrs at every width (default %(default)s)"
    )
    coord.add_argument("--widths", default="64,128,256,512", help="hidden sizes (default %(default)s)")
    coord.add_argument("--steps", type=int, default=10, help="optimizer steps per width (default %(default)s)")
    coord.add_argument("--batch", type=int, default=4)
    coord.add_argument("--seq", type=int, default=64)
    coord.add_argument("--seed", type=int, default=0)
    coord.add_argument("--device", default="cpu")
    coord.add_argument(
        "--init-base-width",
        type=int,
        default=None,
        metavar="W",
        help="draw weights with std 0.02 sqrt(W / width) (muP's 1/sqrt(fan_in)) instead of 0.02",
    )
    coord.add_argument("--tolerance", type=float, default=0.25, help="flag |exponent in width| above this")
    coord.add_argument("--out", default=None, help="write coord_check.md, .json and .png here")
    plan = sub.add_parser(
        "plan", help="what an optimizer step sends and computes per rank on a device mesh of any size"
    )
    plan.add_argument(
        "model",
        help="FAMILY[:SIZE] of equiopt.models (default size paper, e.g. qwen3:paper, "
        "gpt_oss:paper), or a transformers config name or local path",
    )
    plan.add_argument("--recipe", default="equiopt:default", help="recipe (default %(default)s)")
    plan.add_argument(
        "--mesh",
        required=True,
        metavar="dp_shard=64,tp=8[,ep=..,dp_replicate=..]",
        help="mesh dimension sizes; the world is their product, ep excepted (carved out of dp_shard x tp, as torchtitan does)",
    )
    plan.add_argument(
        "--ranks", default=None, metavar="R,...", help="ranks to plan (default: every rank; the busiest is reported)"
    )
    plan.add_argument(
        "--cost-model",
        default="nccl-h100",
        help="constants that choose between reduce and owner plans: nccl-h100 (default), gloo-cpu, reduce, owner",
    )
    plan.add_argument("--json", default=None, metavar="FILE", help="also write the plan as JSON")
    sub.add_parser("fields", help="every rule's settings: the rules that read each one, its defaults, its meaning")
    sub.add_parser("bench", help="step-time and accuracy benchmarks (python -m equiopt.bench --help)", add_help=False)
    args, rest = parser.parse_known_args(argv)
    passthrough = ("data", "plot", "table", "bench")
    if rest and args.command not in passthrough:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "demo":
        if args.quick:
            from .demos.quick import main as quick_demo

            quick_demo(steps=args.steps or 300, seed=0 if args.seed is None else args.seed)
        else:
            from .demos.pretrain import main as train_demo

            train_demo(out=args.out, steps=args.steps, seed=args.seed)
    elif args.command == "data":
        from .data.prepare import main as data_main

        return data_main(rest) or 0
    elif args.command == "train":
        _run_configs([args.config], parse_sets(args.set), resume=args.resume, resume_from=args.resume_from)
    elif args.command == "compare":
        return _compare(args, argv)
    elif args.command == "plot":
        from .study.plots import main_plot

        return main_plot(rest) or 0
    elif args.command == "table":
        from .study.compare_table import main_table

        return main_table(rest) or 0
    elif args.command == "roles":
        from .recipes import get_recipe
        from .roles import assign_roles

        model = _load_model(args.model)
        if args.model.startswith("torchtitan:"):  # with the conventions torchtitan's modules do not declare
            from .integrations.torchtitan import role_table as assign_roles
        try:
            print(assign_roles(model).format(get_recipe(args.recipe), reasons=not args.no_reasons))
        except (ValueError, TypeError) as err:  # RoleInferenceError, an unknown recipe, not a module
            raise SystemExit(f"equiopt roles: {err}") from None
        if args.check_replicas:
            return _check_replicas(model)
    elif args.command == "plan":
        from . import planning

        try:
            sizes = planning.parse_mesh(args.mesh)
            ranks = [int(r) for r in args.ranks.split(",")] if args.ranks else None
            doc = planning.plan_model(args.model, args.recipe, sizes, ranks, args.cost_model)
        except (ValueError, TypeError, OSError) as err:  # a bad mesh, recipe or model; unsupported placements
            raise SystemExit(f"equiopt plan: {err}") from None
        print(planning.format_plan(doc))
        if args.json:
            planning.write_json(doc, args.json)
    elif args.command == "coord-check":
        from .study.coord_check import coord_check, coord_table, write_outputs

        try:
            widths = [int(w) for w in args.widths.split(",") if w.strip()]
            result = coord_check(
                args.model,
                args.recipe,
                widths,
                steps=args.steps,
                batch=args.batch,
                seq=args.seq,
                seed=args.seed,
                device=args.device,
                init_base_width=args.init_base_width,
                tail=min(3, args.steps),
                tolerance=args.tolerance,
            )
        except (ValueError, FloatingPointError) as err:
            raise SystemExit(f"equiopt coord-check: {err}") from None
        print(coord_table(result), end="")
        if args.out:
            for path in write_outputs(result, args.out):
                print(path)
    elif args.command == "fields":
        from .optim.fields import fields_table

        print(fields_table())
    elif args.command == "bench":
        from .bench import main as bench_main

        bench_main(rest)
    return 0


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return n


def _seed_list(text: str) -> list[int]:
    """``N`` (seeds 0..N-1) or ``S1,S2,...``."""
    try:
        if "," not in text:
            n = int(text)
            if n < 1:
                raise ValueError
            return list(range(n))
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N (seeds 0..N-1) or a list S1,S2,..., got {text!r}") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"expected distinct seeds, got {text!r}")
    return seeds


def _compare(args, argv) -> int:
    """``equiopt compare``: train (or reuse) the runs, print the table, paired differences and figures."""
    from .study.paired import sweep, sweep_report
    from .study.runpool import RunFailed

    sets = parse_sets(args.set)
    command = "equiopt " + " ".join(sys.argv[1:] if argv is None else argv)
    protocol = None
    if args.protocol:
        from .study.protocol import load_protocol

        fixed = [
            f for f in ("configs", "seeds", "tune_seeds", "sweep_lr", "sweep_roles", "baseline") if getattr(args, f)
        ]
        if fixed:
            raise SystemExit(
                f"equiopt compare --protocol: the protocol fixes {', '.join('--' + f.replace('_', '-') for f in fixed)}; "
                "edit the protocol (before its runs) instead"
            )
        try:
            protocol = load_protocol(args.protocol, allow_overlap=args.allow_seed_overlap)
        except (OSError, ValueError) as err:
            raise SystemExit(f"equiopt compare: {err}") from None
        args.configs, args.baseline, args.metric = protocol.configs, protocol.baseline, protocol.metric
        args.seeds = protocol.eval_seeds
        sets = {**parse_sets([f"{k}={toml_value(v)}" for k, v in protocol.sets.items()]), **sets}
        protocol = _guarded(protocol, sets)
        if protocol.hidden is not None:
            return _compare_two(args, sets, command, protocol)
        if protocol.sweeps:
            args.sweep_lr = protocol.multipliers
            args.sweep_roles = ",".join(protocol.roles) if protocol.roles else None
            args.tune_seeds = protocol.tune_seeds
    if not args.configs:
        raise SystemExit("equiopt compare: give the configs to compare, or --protocol")
    if args.sweep_lr:
        if not args.baseline:
            raise SystemExit("equiopt compare --sweep-lr: name the baseline with --baseline")
        mults = (
            args.sweep_lr
            if not isinstance(args.sweep_lr, str)
            else [float(m) for m in args.sweep_lr.split(",") if m.strip()]
        )
        roles = [r.strip() for r in args.sweep_roles.split(",")] if args.sweep_roles else None
        tune = args.tune_seeds
        if tune is not None and not args.protocol and args.seeds is None:
            raise SystemExit(
                "equiopt compare --tune-seeds: give the evaluation seeds too (--seeds), disjoint from them"
            )
        from .study.guards import hold_untrained

        held: dict[str, str] = {}
        try:
            arms = sweep(
                args.configs,
                mults,
                args.seeds if args.seeds is not None else [0],
                roles=roles,
                sets=sets,
                force=args.force,
                tune_seeds=tune,
                metric=args.metric,
                allow_overlap=args.allow_seed_overlap,
                jobs=args.jobs,
                hold=None if protocol is None else hold_untrained(protocol, held),
            )
            if held:
                raise ValueError("held, no evaluation runs:\n- " + "\n- ".join(held.values()))
            baseline = baseline_label(args.baseline, args.configs, arms)
            print(sweep_report(arms, baseline, args.metric, out=args.report, command=command, protocol=protocol))
        except (ValueError, RunFailed) as err:
            raise SystemExit(f"equiopt compare: {err}") from None
        except KeyboardInterrupt:
            print("equiopt compare: interrupted; finished runs are kept and skipped by the next call", file=sys.stderr)
            return 130
        if args.report:
            print(f"report: {args.report}")
        return 0
    if args.jobs > 1:
        raise SystemExit(
            "equiopt compare --jobs: runs side by side are for learning-rate sweeps (--sweep-lr or a protocol with a grid)"
        )
    overlap = sorted(set(protocol.tune_seeds) & set(args.seeds)) if protocol is not None else []
    return _compare_fixed(args, sets, command, protocol, overlap)


def _guarded(protocol, sets):
    """The protocol, refused when its design has a problem (equiopt.study.guards) and a run would
    start; when every run it needs has finished, the problems become the report's warnings."""
    import dataclasses

    from .study.guards import design_problems, runs_pending

    try:
        problems = design_problems(protocol, sets)
        pending = bool(problems) and runs_pending(protocol, sets)
    except (OSError, ValueError) as err:
        raise SystemExit(f"equiopt compare: {err}") from None
    if not problems:
        return protocol
    listed = "\n".join(f"- {p}" for p in problems)
    if pending:
        raise SystemExit(f"equiopt compare: {protocol.path}: refused before any run, its design misleads:\n{listed}")
    print(
        f"equiopt compare: {protocol.path}: design warnings (every run has finished; no new run):\n{listed}",
        file=sys.stderr,
    )
    return dataclasses.replace(protocol, warnings=problems)


def _compare_two(args, sets, command, protocol) -> int:
    """``equiopt compare --protocol`` with ``[tuning.hidden]``: two-factor tuning
    (:mod:`equiopt.study.twofactor`), then the sweep report with both stages and the gap by step."""
    from .study.paired import sweep_report
    from .study.runpool import RunFailed
    from .study.twofactor import gap_lines, hidden_lines, sweep_two

    grids = (
        protocol.multipliers
        if isinstance(protocol.multipliers, dict)
        else dict.fromkeys(protocol.configs, protocol.multipliers)
    )
    try:
        arms = sweep_two(
            protocol.configs,
            grids,
            protocol.roles,
            protocol.hidden["roles"],
            protocol.hidden["grids"],
            protocol.eval_seeds,
            protocol.tune_seeds,
            sets=sets,
            extend=protocol.extend,
            min_hidden_rms_change=protocol.min_hidden_rms_change,
            metric=protocol.metric,
            jobs=args.jobs,
            force=args.force,
        )
    except (ValueError, RunFailed) as err:
        raise SystemExit(f"equiopt compare: {err}") from None
    except KeyboardInterrupt:
        print("equiopt compare: interrupted; finished runs are kept and skipped by the next call", file=sys.stderr)
        return 130
    extra = hidden_lines(arms, protocol.tune_seeds, protocol.metric)
    held = [a.held for a in arms if a.held]
    if held:
        print("\n".join(extra))
        raise SystemExit("equiopt compare: held, no evaluation runs:\n- " + "\n- ".join(held))
    baseline = baseline_label(protocol.baseline, protocol.configs, arms)
    pairs = [(c.arm, c.baseline or baseline) for c in protocol.claims]
    extra += gap_lines(arms, pairs, protocol.eval_seeds, protocol.metric)
    sweeps = [a.sweep_arm(protocol.tune_seeds, protocol.eval_seeds) for a in arms]
    text = sweep_report(sweeps, baseline, protocol.metric, out=args.report, command=command, protocol=protocol)
    text += "\n" + "\n".join(extra)
    if args.report:
        Path(args.report).write_text(text + "\n")
        print(f"report: {args.report}")
    print(text)
    return 0


def toml_value(value) -> str:
    """``value`` written as a TOML value (what ``--set section.field=VALUE`` reads back)."""
    from ._tomlw import toml_value as written

    return written(value)


def _compare_fixed(args, sets, command, protocol, overlap) -> int:
    """``equiopt compare`` without a sweep: every config on every evaluation seed, as configured."""
    from .study.compare_table import compare_rows, compare_table
    from .study.paired import RunProgress, paired_rows, paired_table
    from .study.plots import plot_runs

    seeds = args.seeds if args.seeds is not None else [None]
    out_dirs = []
    runs = RunProgress(len(args.configs) * len(seeds))
    for config in args.configs:
        for seed in seeds:
            start = time.time()
            dirs = _run_seed(config, sets, seed, args.force)
            runs.done(", ".join(Path(d).name for d in dirs), reused=all(_untouched_since(d, start) for d in dirs))
            out_dirs += dirs
    table = compare_table(out_dirs, metric=args.metric)
    text = []
    if overlap:
        text += [
            f"**Seed overlap: evaluation seed(s) {', '.join(map(str, overlap))} also tuned the learning rates "
            "(allowed explicitly); the differences are optimistic for the tuned arms.**",
            "",
        ]
    if protocol is not None:
        text += protocol.header() + [""]
    text += [table]
    pairs = []
    if args.baseline:
        rows = compare_rows(out_dirs, metric=args.metric)
        labels = {}
        per_config = len(seeds)
        for config, row_label in zip(args.configs, _labels_by_config(args.configs, rows, out_dirs, per_config)):
            labels[config] = row_label
        baseline = labels.get(args.baseline, args.baseline)
        try:
            pairs = paired_rows(rows, baseline, metric=args.metric)
        except ValueError as err:
            raise SystemExit(f"equiopt compare: {err}") from None
        text += ["", paired_table(pairs)]
        if protocol is not None:
            text += [""] + protocol.verdict_lines(rows)
    print("\n".join(text))
    figures = plot_runs(out_dirs, args.out or str(Path(out_dirs[0]).parent / "plots"))
    for path in figures:
        print(path)
    if args.report:
        report = Path(args.report)
        report.parent.mkdir(parents=True, exist_ok=True)
        listed = "\n".join(f"- `{d}`" for d in out_dirs)
        figs = "\n".join(
            f"![{Path(p).stem}]({Path(os.path.relpath(Path(p).resolve(), report.parent.resolve())).as_posix()})"
            for p in figures
        )
        body = "\n".join(text)
        first = ""
        if body.startswith("**Seed overlap"):
            first, body = body.split("\n", 1)
            first += "\n\n"
        report.write_text(
            f"{first}# Comparison\n\nCommand:\n\n```bash\n{command}\n```\n\n"
            + body
            + f"\n\nRuns (each value is the last record of the metric in its `log.jsonl`):\n\n{listed}\n\n"
            + figs
            + "\n"
        )
        print(f"report: {report}")
    return 0


def _labels_by_config(configs, rows, out_dirs, n_seeds) -> list[str]:
    """The compare-table label of each config's runs (configs run in order, ``n_seeds`` each)."""
    out = []
    for i, _ in enumerate(configs):
        first = str(Path(out_dirs[i * max(1, n_seeds)]))
        match = [r.label for r in rows if first in r.paths]
        out.append(match[0] if match else "")
    return out


def baseline_label(baseline: str, configs, arms) -> str:
    """The label of the arm whose config is ``baseline``; ``baseline`` itself where none is (a label)."""
    for config, arm in zip(configs, arms):
        if baseline == config:
            return arm.label
    return baseline


def _untouched_since(run_dir: str, start: float) -> bool:
    """The run was reused, not trained: its log exists and was last written before ``start``
    (with a second's slack: a file system's timestamps can lag the clock)."""
    log = Path(run_dir) / "log.jsonl"
    return log.exists() and log.stat().st_mtime < start - 1.0


def _run_seed(config: str, sets: dict, seed: int | None, force: bool) -> list[str]:
    """A config as is (``seed=None``) or with ``run.seed = seed`` in its own ``<out_dir>-s<seed>``."""
    from .train import load_config

    seeded = dict(sets)
    if seed is not None:
        cfg = load_config(config, sets)
        seeded.update(
            {"run.seed": seed, "run.out_dir": f"{cfg.out_path}-s{seed}", "run.name": f"{cfg.run.name}-s{seed}"}
        )
    return _run_configs([config], seeded, resume=False, force=force)


if __name__ == "__main__":
    sys.exit(main())
