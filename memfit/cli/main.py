"""``memfit``: the command line. Subcommands import what they need lazily, so ``memfit plan`` runs with
nothing but the core installed (no kopf, no torch).

Exit codes (memfit.cli.exit_codes): 0 done, 1 nothing fits, 2 bad input (one line naming the file, the object
and the field), 3 an internal error (one line; the traceback only with ``--debug``), 130 interrupted.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from memfit.api.base import escaped
from memfit.cli.exit_codes import ExitCode

DEBUG_HELP = "on an internal error, print the traceback (without it: one line)"
INTERNAL_ERROR_LENGTH = 300
"""Characters of an internal error's message shown."""


CLAIM_DIRECTORY = "local directory standing in for a PersistentVolumeClaim (default: DIR named CLAIM beside the job)"


def _add_mount(parser: argparse.ArgumentParser, help: str) -> None:
    parser.add_argument("--mount", action="append", default=[], metavar="CLAIM=DIR", help=help)


def _plan(args: argparse.Namespace) -> int:
    from memfit.cli.plan_command import run_plan

    return run_plan(
        args.job,
        args.inventory,
        args.output,
        args.emit_ds_config,
        args.job_name,
        args.max_sequence_length,
        args.mount,
        args.trainer_packages,
    )


def _run(args: argparse.Namespace) -> int:
    if not args.local:
        print("memfit run: only --local is supported: on a cluster, `kubectl apply -f` the job", file=sys.stderr)
        return ExitCode.BAD_INPUT
    from memfit.cli.run_command import run_local

    return run_local(args.job, args.nproc, args.mount, args.workdir, args.dry_run)


def _data_preview(args: argparse.Namespace) -> int:
    from memfit.cli.data_preview import run_preview

    return run_preview(args.job, args.mount, args.n, args.output)


def _profile(args: argparse.Namespace) -> int:
    from memfit.cli.profile_command import run_profile

    return run_profile(args.model, args.output, args.lora_targets, args.activations)


def _crd(args: argparse.Namespace) -> int:
    from memfit.api.crd import crd_documents_yaml

    sys.stdout.write(crd_documents_yaml())
    return ExitCode.OK


def _operator(args: argparse.Namespace) -> int:
    from dataclasses import replace

    # The one place the core reaches into the operator package, lazily: `memfit operator` is how the
    # operator image starts it, and nothing else in `memfit` needs kopf or kubernetes installed.
    from memfit_operator.main import run_operator
    from memfit_operator.settings import OperatorSettings

    flags: dict[str, Any] = {
        "namespace": args.namespace,
        "trainer_image": args.trainer_image,
        "trainer_cpu_image": args.trainer_cpu_image,
        "standalone": args.standalone or None,
        "peering": args.peering,
        "metrics_port": args.metrics_port,
        "health_port": args.health_port,
    }
    settings = replace(OperatorSettings.from_environment(), **{k: v for k, v in flags.items() if v is not None})
    ports: dict[str, Any] = {"metrics_port": settings.metrics_port or None, "health_port": settings.health_port or None}
    run_operator(replace(settings, **ports))
    return ExitCode.OK


def _presets(args: argparse.Namespace) -> int:
    from memfit.cli.catalog_command import print_catalog

    print_catalog(profiles_only=args.profiles)
    return ExitCode.OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="memfit", description="Fit LLM fine-tuning into the GPUs you have.")
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    # `--debug` after the command works too (SUPPRESS: absent there, it leaves the top-level value alone).
    debug = argparse.ArgumentParser(add_help=False)
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    plan = commands.add_parser("plan", parents=[debug], help="will this job fit, and how? (offline, no cluster)")
    plan.add_argument("job", type=Path, help="YAML file with the FineTuneJob (may also hold GPUPools)")
    plan.add_argument(
        "--inventory", "-i", type=Path, action="append", default=[], help="YAML file with GPUPool objects (repeatable)"
    )
    plan.add_argument("--output", "-o", choices=["table", "json", "yaml"], default="table")
    plan.add_argument(
        "--emit-ds-config",
        type=Path,
        metavar="FILE",
        help="write the chosen plan's DeepSpeed config JSON here, as the operator renders it",
    )
    plan.add_argument("--job", dest="job_name", metavar="NAME", help="which FineTuneJob, if the file holds several")
    plan.add_argument(
        "--max-sequence-length",
        action="store_true",
        help="instead of one plan: the longest sequenceLength the job fits on each pool, and the plan that reaches it",
    )
    _add_mount(plan, "directory standing in for the model's claim: a job without spec.model.architecture is "
               "planned from the config.json there (default: DIR named CLAIM beside the job)")  # fmt: skip
    plan.add_argument(
        "--trainer-packages",
        metavar="PKG[,PKG]",
        default="",
        help="kernel packages the trainer has beyond torch (flash-attn, flash-linear-attention); default: none, as "
        "memfit's trainer image (the chart's trainer.kernelPackages says what a cluster's image carries)",
    )
    plan.set_defaults(handler=_plan)

    run = commands.add_parser("run", parents=[debug], help="plan for this machine and train here (--local)")
    run.add_argument("job", type=Path, help="YAML file with one FineTuneJob")
    run.add_argument("--local", action="store_true", help="run on this machine (its GPUs, or CPU processes)")
    run.add_argument("--nproc", type=int, metavar="N", help="ranks (default: every GPU, or 2 CPU processes)")
    _add_mount(run, CLAIM_DIRECTORY)
    run.add_argument("--workdir", type=Path, help="where the rendered configs go (default: the output dir/.memfit)")
    run.add_argument("--dry-run", action="store_true", help="plan and render the configs, do not train")
    run.set_defaults(handler=_run)

    data = commands.add_parser("data", parents=[debug], help="look at a job's training data as the trainer sees it")
    data_commands = data.add_subparsers(dest="data_command", required=True, metavar="COMMAND")
    preview = data_commands.add_parser(
        "preview", parents=[debug], help="the first sequences, targets marked, and token statistics (no GPU)"
    )
    preview.add_argument("job", type=Path, help="YAML file with one FineTuneJob")
    _add_mount(preview, CLAIM_DIRECTORY)
    preview.add_argument("-n", type=int, default=3, metavar="N", help="sequences to show (default 3)")
    preview.add_argument("-o", "--output", choices=("text", "json"), default="text", help="output format")
    preview.set_defaults(handler=_data_preview)

    profile = commands.add_parser(
        "profile", parents=[debug], help="a model's parameters by role and layer type, built from its config.json"
    )
    profile.add_argument("model", help="directory holding config.json, a config.json, or a stored config's name")
    profile.add_argument("-o", "--output", choices=("text", "json"), default="text", help="output format")
    profile.add_argument(
        "--lora-targets",
        action="append",
        default=[],
        metavar="NAMES",
        help="also resolve these comma-separated LoRA target_modules (repeatable; all-linear always)",
    )
    profile.add_argument(
        "--activations",
        action="store_true",
        help="also trace activation bytes per layer type (fake tensors; seconds to a minute)",
    )
    profile.set_defaults(handler=_profile)

    crd = commands.add_parser(
        "crd", parents=[debug], help="print the CustomResourceDefinitions generated from the API models"
    )
    crd.set_defaults(handler=_crd)

    operator = commands.add_parser(
        "operator", parents=[debug], help="run the Kubernetes operator (kubeconfig, or in-cluster credentials in a pod)"
    )
    operator.add_argument("--namespace", "-n", help="serve only this namespace (default: all namespaces)")
    operator.add_argument("--trainer-image", help="image of the trainer pods (env MEMFIT_TRAINER_IMAGE)")
    operator.add_argument(
        "--trainer-cpu-image",
        help="image of the trainer pods on CPU pools, gpuProduct cpu (env MEMFIT_TRAINER_CPU_IMAGE; "
        "default: --trainer-image)",
    )
    operator.add_argument("--standalone", action="store_true", help="no peering: a single replica")
    operator.add_argument("--peering", help="(Cluster)KopfPeering the replicas coordinate through (default memfit)")
    operator.add_argument("--metrics-port", type=int, help="Prometheus /metrics port (default 8080; 0 turns it off)")
    operator.add_argument("--health-port", type=int, help="/healthz port for probes (default 8081; 0 turns it off)")
    operator.set_defaults(handler=_operator)

    presets = commands.add_parser("presets", parents=[debug], help="list the built-in model presets and GPU products")
    presets.add_argument("--profiles", action="store_true", help="only the presets planned from stored profiles")
    presets.set_defaults(handler=_presets)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args))
    except KeyboardInterrupt:
        print("memfit: interrupted", file=sys.stderr)
        return ExitCode.INTERRUPTED
    except Exception as error:  # the last resort: a bug, reported in one line rather than a traceback
        if args.debug:
            traceback.print_exc()
        print(internal_error_line(error, args.debug), file=sys.stderr)
        return ExitCode.INTERNAL_ERROR


def internal_error_line(error: BaseException, debug: bool = False) -> str:
    """`memfit: internal error: KeyError: 'x'`, escaped and cut short (the message may quote the input)."""
    text = escaped(f"{type(error).__name__}: {error}"[:INTERNAL_ERROR_LENGTH])
    if len(text) > INTERNAL_ERROR_LENGTH:
        text = text[: INTERNAL_ERROR_LENGTH - 3] + "..."
    hint = "" if debug else " (run `memfit --debug ...` for the traceback)"
    return f"memfit: internal error: {text}{hint}"


if __name__ == "__main__":
    sys.exit(main())
