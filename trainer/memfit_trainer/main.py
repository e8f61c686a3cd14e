"""``memfit-train --config FILE``: the process inside each training pod (one per GPU, under torchrun).

Exit codes: 0 done (or already done), or stopped by SIGTERM or SIGINT after a checkpoint of the step reached
(a Stopped termination message: memfit_trainer.stop), 2 the config cannot be run here or another run holds the
output directory (one line on stderr and a ConfigError termination message, before any GPU work and before
anything in the output directory is read or written: memfit_trainer.output_lock), 86 out of GPU memory (see
:mod:`memfit_trainer.oom`), 1 anything else. torchrun reports a failed worker as 1: the termination message
(memfit.contract.termination) keeps the reason. A config that cannot be read whole still names where its
termination message goes when its ``terminationLog`` can be read; otherwise the message goes to the default
path (the pod's).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from collections.abc import Sequence

from memfit.api.vocabulary import TerminationReason
from memfit.contract.lifetime import signal_when_parent_dies
from memfit.contract.reader import ConfigError, load_config
from memfit.contract.termination import (
    DEFAULT_TERMINATION_LOG,
    completed_message,
    report_config_error,
    report_refusal,
    stopped_message,
    write_termination_message,
)
from memfit.contract.trainer_config import TrainerConfig

EXIT_CONFIG = 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="memfit-train", description="Run one memfit training job (one rank).")
    parser.add_argument("--config", required=True, help="the trainer config JSON the operator rendered")
    return parser


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _single_process_defaults() -> None:
    """Started without torchrun (one rank, e.g. ``memfit run --local``): describe a world of one."""
    if "RANK" in os.environ:
        return
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))


def _stop_with_launcher() -> None:
    """Under torchrun (which starts each rank in a session of its own): a SIGTERM when torchrun ends, however
    it ends, so that no rank trains on as an orphan (memfit.contract.lifetime); it stops as on any SIGTERM."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        signal_when_parent_dies()


def run(config: TrainerConfig) -> int:
    """Initialise the process group, train, tear down; the exit code."""
    import torch
    import torch.distributed as dist

    from memfit_trainer.data import DataError
    from memfit_trainer.disk_space import NoSpaceLeft
    from memfit_trainer.engine import init_process_group
    from memfit_trainer.loop import NonFiniteStep, train
    from memfit_trainer.metrics import TrainerMetrics
    from memfit_trainer.oom import OomGuard
    from memfit_trainer.output_lock import lock_output_dir
    from memfit_trainer.run import Ranks
    from memfit_trainer.stop import StopRequest
    from memfit_trainer.tokenizer import TokenizerLoadError

    stop = StopRequest()
    stop.install()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
    init_process_group(config)
    ranks = Ranks(rank=dist.get_rank(), local_rank=local_rank, world_size=dist.get_world_size())
    guard = OomGuard(
        planned_peak_bytes=config.prediction.peak_allocated_bytes if config.prediction else None,
        termination_log=config.termination_log,
    )
    metrics = TrainerMetrics.from_config(
        config, rank=ranks.rank, local_rank=ranks.local_rank, world_size=ranks.world_size
    )
    try:
        lock_output_dir(config, ranks.rank)
        with guard:  # model loading and engine set-up (step None) too, not only the steps
            stopped_at = train(config, ranks, metrics, guard, stop)
    except (ConfigError, DataError, TokenizerLoadError) as error:
        report_config_error(str(error), config.termination_log)
        return EXIT_CONFIG
    except NoSpaceLeft as error:
        report_refusal(TerminationReason.NO_SPACE, str(error), config.termination_log)
        return EXIT_CONFIG
    except NonFiniteStep as error:
        report_refusal(TerminationReason.NON_FINITE, str(error), config.termination_log)
        return EXIT_CONFIG
    finally:
        metrics.close()
    if stopped_at is not None:
        if ranks.local_rank == 0:  # one message per pod
            write_termination_message(stopped_message(stopped_at, stop.describe()), config.termination_log)
    elif metrics.last_progress is not None:  # rank 0: the final progress, for the operator
        write_termination_message(completed_message(metrics.last_progress), config.termination_log)
    dist.destroy_process_group()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    config: TrainerConfig | None = None
    _stop_with_launcher()
    try:
        config = load_config(args.config)
        _single_process_defaults()
        from memfit_trainer.preflight import check

        check(config, os.environ)
        from memfit_trainer.data import check_before_start

        check_before_start(config)  # rank 0: every data record, before the process group and the weights
    except ConfigError as error:
        if config is not None:
            termination_log = config.termination_log
        else:
            termination_log = error.termination_log or DEFAULT_TERMINATION_LOG
        report_config_error(str(error), termination_log)
        return EXIT_CONFIG
    return run(config)


if __name__ == "__main__":
    sys.exit(main())
