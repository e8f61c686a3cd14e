"""``python -m memfit_trainer.launch_check --config FILE``: what the trainer's ranks would refuse at start-up,
found before ``memfit run --local`` starts them under torchrun (where each rank would find it after the
others had started).

It takes the trainer's own start-up steps, short of the model's weights and the process group: the config
read and checked against this machine as the plan's ranks will see it (:mod:`memfit_trainer.preflight`), the
tokenizer loaded and the model's config read and compared with the plan
(:func:`memfit_trainer.model.build_tokenizer`, :func:`memfit_trainer.model.checked_config`), the training and
validation data built (:func:`memfit_trainer.validation.config_data`; it tokenises the data once, as the
trainer does). Every rank builds the same blocks and keeps its own slice of each step, so rank 0's build
raises what every rank's would (a dataset too small for one micro-batch per rank). A streamed dataset is not
read ahead: the trainer cannot know its epoch's length, and neither does this.

Exit 0 and nothing said, or 2 and the trainer's own one line (``memfit-train: ...``) on stderr; no
termination message is written (there is no pod).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from memfit.contract.reader import ConfigError, load_config
from memfit.contract.termination import CONFIG_ERROR_PREFIX
from memfit.contract.trainer_config import TrainerConfig
from memfit_trainer.data import DataError
from memfit_trainer.main import EXIT_CONFIG
from memfit_trainer.model import build_tokenizer, checked_config
from memfit_trainer.preflight import check
from memfit_trainer.tokenizer import TokenizerLoadError
from memfit_trainer.validation import config_data


def launch_check(config: TrainerConfig) -> None:
    """Raise what the trainer's start-up would raise for ``config`` on this machine, in the trainer's order."""
    ranks = str(config.world_size)  # torchrun starts them all here (memfit run --local is one machine)
    check(config, {**os.environ, "WORLD_SIZE": ranks, "LOCAL_WORLD_SIZE": ranks})
    tokenizer = build_tokenizer(config)
    checked_config(config)
    config_data(config, tokenizer, rank=0, world_size=config.world_size)


def quiet_libraries() -> None:
    """Only the one line: what datasets and transformers say while loading (progress bars, a file they cannot
    parse, which the refusal then names) is for the trainer's log."""
    import datasets
    import transformers

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(logging.CRITICAL)
    transformers.logging.set_verbosity(logging.CRITICAL)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="memfit_trainer.launch_check", description="What the trainer would refuse at start-up, found first."
    )
    parser.add_argument("--config", required=True, help="the trainer config JSON memfit run --local rendered")
    args = parser.parse_args(argv)
    quiet_libraries()
    try:
        launch_check(load_config(args.config))
    except (ConfigError, DataError, TokenizerLoadError) as error:  # what memfit_trainer.main refuses with exit 2
        print(f"{CONFIG_ERROR_PREFIX}{error}", file=sys.stderr)
        return EXIT_CONFIG
    return 0


if __name__ == "__main__":
    sys.exit(main())
