"""Unit cases for every alert, run by `promtool test rules` (test_rules.py turns them into its test file).

Each case: input series (promtool's expanding notation, one sample a minute), then for some evaluation
times the alerts expected to be firing, by their labels and rendered summary. The descriptions are static
text checked elsewhere; promtool compares all annotations, so the test copies them from the rule.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Expect:
    at: str
    firing: list[tuple[dict[str, str], str]] = field(default_factory=list)
    """(labels without alertname and severity, summary) of each firing alert."""


@dataclass
class Case:
    alert: str
    series: dict[str, str]
    expect: list[Expect]


JOB = 'finetunejob="research/big"'
CASES = [
    Case(
        "MemfitGPUMemoryNearCapacity",
        {
            f'memfit_gpu_memory_peak_allocated_bytes{{{JOB},rank="0",device="cuda:0",pod="big-a1-n0"}}': "70e9x10",
            f'memfit_gpu_memory_peak_allocated_bytes{{{JOB},rank="1",device="cuda:1",pod="big-a1-n0"}}': "79e9x10",
            f'memfit_gpu_capacity_bytes{{{JOB},rank="0",pod="big-a1-n0"}}': "80e9x10",
            f'memfit_gpu_capacity_bytes{{{JOB},rank="1",pod="big-a1-n0"}}': "80e9x10",
        },
        [
            Expect("1m"),  # pending: for 2m
            Expect(
                "5m",
                [
                    (
                        {"finetunejob": "research/big", "rank": "1"},
                        "research/big rank 1 peaked at 98.75% of its GPU's memory",
                    )
                ],
            ),
        ],
    ),
    Case(
        "MemfitGPUMemoryAbovePrediction",
        {
            f'memfit_gpu_memory_peak_allocated_bytes{{{JOB},rank="0",device="cuda:0"}}': "30e9x15",
            f'memfit_gpu_memory_peak_allocated_bytes{{{JOB},rank="1",device="cuda:1"}}': "22e9x15",
            f'memfit_predicted_peak_allocated_bytes{{{JOB},rank="0"}}': "20e9x15",
            f'memfit_predicted_peak_allocated_bytes{{{JOB},rank="1"}}': "20e9x15",
        },
        [
            Expect("3m"),  # pending: for 5m
            Expect(
                "10m",
                [
                    (
                        {"finetunejob": "research/big", "rank": "0"},
                        "research/big rank 0 uses 1.5x the memory its plan predicted",
                    )
                ],
            ),
        ],
    ),
    Case(
        "MemfitThroughputCollapsed",
        {
            f'memfit_train_tokens_per_second{{{JOB},rank="0"}}': "1000x20 300x40",
            f'memfit_train_tokens_per_second{{{JOB},rank="1"}}': "1000x20 300x40",
            'memfit_train_tokens_per_second{finetunejob="research/steady",rank="0"}': "800x60",
        },
        [
            Expect("15m"),
            Expect("25m"),  # below half since 21m, pending: for 10m
            Expect(
                "40m",
                [
                    (
                        {"finetunejob": "research/big"},
                        "research/big trains at 600 tokens/s, under 50% of its best in 30m",
                    )
                ],
            ),
        ],
    ),
    Case(
        "MemfitJobFailed",
        {
            'memfit_job_phase{finetunejob="research/a",phase="Running"}': "1x5",
            'memfit_job_phase{finetunejob="research/a",phase="Failed"}': "_x5 1x10",
            'memfit_job_phase{finetunejob="research/b",phase="Succeeded"}': "1x15",
        },
        [Expect("3m"), Expect("10m", [({"finetunejob": "research/a"}, "FineTuneJob research/a failed")])],
    ),
    Case(
        "MemfitRepeatedOOMReplans",
        {
            'memfit_job_replans{finetunejob="research/a"}': "0 0 1 1 2 2 2 2 2 2",
            'memfit_job_replans{finetunejob="research/b"}': "0 1 1 1 1 1 1 1 1 1",
        },
        [
            Expect("3m"),
            Expect(
                "7m", [({"finetunejob": "research/a"}, "research/a ran out of GPU memory and was re-planned 2 times")]
            ),
        ],
    ),
    Case(
        "MemfitNoProgress",
        {
            'memfit_train_step{finetunejob="research/hung",rank="0"}': "1+1x10 11x30",
            'memfit_train_step{finetunejob="research/hung",rank="1"}': "1+1x10 11x30",
            'memfit_train_progress_ratio{finetunejob="research/hung",rank="0"}': "0.01+0.01x10 0.11x30",
            'memfit_train_step{finetunejob="research/done",rank="0"}': "1+1x10 11x30",  # finished: saving
            'memfit_train_progress_ratio{finetunejob="research/done",rank="0"}': "0.1+0.1x9 1x30",
            'memfit_train_step{finetunejob="research/slow",rank="0"}': "1x9 2x9 3x9 4x9",  # a step each 10 min
        },
        [
            Expect("20m"),
            Expect(
                "35m", [({"finetunejob": "research/hung"}, "research/hung finished no optimizer step in 15 minutes")]
            ),
        ],
    ),
]
