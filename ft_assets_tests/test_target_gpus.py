"""``gpus=N`` on a GPU target: how it and the training settings' ``num_processes`` agree (``targets.processes_on``), what
the plan and the rented job count, and how the worker reads the end of its N ranks (``targets.ranks.exit_code``,
``remote.ranks_outcome``, a rank's refused keys). Function level, table-driven; the 2 ranks themselves train through
the ssh target against the local sshd in test_remote_worker.py.
"""

from __future__ import annotations

import json

import pytest

from ft_assets.control.assets import PlanConfig, plan_run
from ft_assets.targets import GpuRequest, TargetError, WorkerLaunch, parse_target, processes_on
from ft_assets.targets import ssh
from ft_assets.targets.ranks import exit_code
from ft_assets.targets.renewal import EXIT_KEYS_REFUSED
from ft_assets.storage import KeysRefused
from ft_assets.training import worker
from ft_assets.training.config import TrainingConfig
from ft_assets.training.launch import SHUTDOWN_TIMEOUT_S, refusal_file
from ft_assets.training.remote import ranks_outcome
from ft_assets_tests.test_plan_settings import refs

SETTLED = [  # (target, num_processes, num_nodes, the processes the worker runs, or the refusal's words)
    (None, 1, 1, 1),
    (None, 4, 2, 4),  # local: the settings alone (torchrun here, on each node)
    ("ssh://box", 1, 1, 1),
    ("ssh://box?gpus=2", 1, 1, 2),  # the target says it
    ("ssh://box", 4, 1, 4),  # the settings say it
    ("slurm://login/gpu?gpus=4", 4, 1, 4),  # both, the same number
    ("skypilot:runpod?gpus=8", 1, 1, 8),
    ("ssh://box?gpus=2", 4, 1, "gpus=2 on the target but num_processes 4 in the training settings"),
    ("slurm://login/gpu", 2, 2, "num_nodes 2; a target's worker is one machine"),
]


@pytest.mark.parametrize("target, processes, nodes, settled", SETTLED)
def test_the_targets_gpus_and_the_settings_num_processes_settle_on_one_count(target, processes, nodes, settled):
    training = TrainingConfig(num_processes=processes, num_nodes=nodes)
    if isinstance(settled, str):
        with pytest.raises(TargetError) as caught:
            processes_on(parse_target(target), training)
        assert settled in str(caught.value) and "\n" not in str(caught.value)
    else:
        assert processes_on(parse_target(target), training).num_processes == settled


def test_the_plan_counts_the_targets_gpus_and_a_mismatch_is_refused_before_anything_is_rented():
    shards, base = refs()
    one = plan_run(TrainingConfig(), PlanConfig(), shards, base, cuda=True, target="ssh://box?gpu=h100-80gb").plan
    run = plan_run(TrainingConfig(), PlanConfig(), shards, base, cuda=True, target="ssh://box?gpu=h100-80gb&gpus=2")
    assert run.plan.gpus == 2 and run.training.num_processes == 2  # what lora_adapter's plan_mismatch compares
    assert run.plan.usd_per_hour == pytest.approx(2 * one.usd_per_hour)
    with pytest.raises(ValueError, match="gpus=2 on the target but num_processes 4"):
        plan_run(TrainingConfig(num_processes=4), PlanConfig(), shards, base, cuda=True, target="ssh://box?gpus=2")


def test_skypilot_rents_the_plans_count_of_cards():
    launch = WorkerLaunch("a-1", "ft_assets.training.remote", (), gpu=GpuRequest("a100-80gb", "A100-80GB", 4, "spot"),
                          gpus=4)  # fmt: skip
    assert parse_target("skypilot:runpod?gpus=4").task(launch)["resources"]["accelerators"] == {"A100-80GB": 4}


def test_an_ssh_cancel_waits_for_torchrun_to_give_its_ranks_their_grace():
    """A cancelled worker's ranks checkpoint at their step boundary; torchrun kills them SHUTDOWN_TIMEOUT_S after its
    SIGTERM, and the ssh target must not kill the whole worker before that."""
    assert ssh.CANCEL_GRACE_S > SHUTDOWN_TIMEOUT_S


@pytest.mark.parametrize(
    "codes, code",
    [([0, -9], 137), ([-15, -9], 137), ([1, -15], 143), ([1, 0], 1), ([75, 75], 1)],
)
def test_a_rank_a_signal_ended_makes_the_exit_code_that_of_a_killed_worker(codes, code):
    assert exit_code(codes) == code


def test_the_ranks_end_is_read_from_rank_0s_result_and_the_ranks_refusals(tmp_path):
    result = tmp_path / "result.json"
    assert ranks_outcome(137, result) == {"killed": 137}  # kill -9 of a rank: the next attempt resumes
    assert ranks_outcome(1, result) == {"failed": 1}
    result.write_text(json.dumps({"steps": 4}))
    assert ranks_outcome(0, result) == {"result": {"steps": 4}}
    refusal_file(result, 1).write_text("AccessDenied")
    assert ranks_outcome(1, result) == {"refused": "AccessDenied"}
    result.write_text(json.dumps({"preempted": {"step": 2, "checkpoint": "s3://b/c"}}))
    assert ranks_outcome(1, result) == {"preempted": {"step": 2, "checkpoint": "s3://b/c"}}


def test_a_rank_whose_keys_the_store_refuses_says_so_beside_the_result_and_exits_77(tmp_path, monkeypatch):
    def refused(*args, **kwargs):
        try:
            raise KeysRefused("AccessDenied: the key is expired")
        except KeysRefused as exc:
            raise RuntimeError("checkpoint upload failed") from exc

    monkeypatch.setattr(worker, "train", refused)
    monkeypatch.setenv("RANK", "1")
    result = tmp_path / "result.json"
    argv = ["--base-model", str(tmp_path), "--shards", str(tmp_path), "--store", str(tmp_path / "store"),
            "--run-prefix", "runs/a/v/train/r", "--work-dir", str(tmp_path / "run"), "--result", str(result)]  # fmt: skip
    assert worker.main(argv) == EXIT_KEYS_REFUSED
    assert "the key is expired" in refusal_file(result, 1).read_text() and not result.exists()
