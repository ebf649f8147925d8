"""msrun's command line under relaunch (cli.msrun) and MindSpore's variables
(protocol.environment.mindspore_environment): pure, every way msrun's options can be wrong.
That the variables equal msrun's own is tests/test_mindspore.py's, side by side with msrun."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from relaunch.cli import app
from relaunch.cli.launch import dashed
from relaunch.cli.msrun import from_msrun, msrun_form
from relaunch.protocol.environment import mindspore_environment


def written(*args: str) -> tuple[list[str], list[str], str | None]:
    line = dashed(list(args))
    script = next(i for i, a in enumerate(line) if a.endswith(".py"))
    form = from_msrun(line, script)
    return form.args, form.notes, form.problem


def test_msruns_workers_become_pods_of_its_local_workers_and_the_job_a_mindspore_job() -> None:
    args, notes, problem = written(
        "--worker_num=4", "--local_worker_num", "2", "train.py", "--worker_num", "9"
    )
    assert problem is None and notes == []
    assert args == [
        "--nnodes=2",
        "--nproc-per-node=2",
        "--label=framework=mindspore",
        "train.py",
        "--worker_num",
        "9",  # the script's own, untouched
    ]


def test_msruns_defaults_are_eight_workers_on_one_node() -> None:
    args, _, problem = written("--master_port=8118", "train.py")
    assert problem is None
    assert args[:2] == ["--nnodes=1", "--nproc-per-node=8"]


def test_the_cluster_time_out_is_the_topology_timeout_and_relaunchs_own_options_stay() -> None:
    args, _, problem = written(
        "--worker_num=2", "--local_worker_num=2", "--cluster_time_out", "90", "--state-dir",
        "st", "train.py",
    )  # fmt: skip
    assert problem is None
    assert args[:2] == ["--state-dir", "st"] and "--env=MS_TOPO_TIMEOUT=90" in args


def test_options_that_mean_nothing_under_relaunch_are_noted_each_saying_why() -> None:
    _, notes, problem = written(
        "--worker_num=2", "--local_worker_num=2", "--master_addr=10.0.0.1", "--master_port=9",
        "--node_rank=0", "--log_dir=logs", "--join=True", "--worker_log_name=w",
        "--tail_worker_log=0", "train.py",
    )  # fmt: skip
    assert problem is None
    named = [note.split(" is not used: ")[0] for note in notes]
    assert named == [
        f"msrun's --{n}"
        for n in (
            "master_addr", "master_port", "node_rank", "log_dir", "join", "worker_log_name",
            "tail_worker_log",
        )
    ]  # fmt: skip
    assert all(note.split(" is not used: ")[1] for note in notes)


@pytest.mark.parametrize(
    ("option", "why"),
    [
        ("--bind_core=True", "does not pin cores"),
        ("--bind_numa=True", "does not pin NUMA"),
        ("--sim_level=1", "dry run"),
        ("--sim_rank_id=0", "dry run"),
        ("--rank_table_file=table.json", "dynamic networking"),
    ],
)
def test_options_that_would_change_what_runs_are_refused_saying_why(option: str, why: str) -> None:
    _, _, problem = written("--worker_num=2", "--local_worker_num=2", option, "train.py")
    assert problem is not None and option.split("=")[0] in problem and why in problem


@pytest.mark.parametrize(
    ("options", "said"),
    [
        (("--worker_num=3", "--local_worker_num=2"), "not a whole number of nodes"),
        (("--worker_num=0", "--local_worker_num=2"), "not a whole number of nodes"),
        (("--worker_num=two",), "numbers"),
        (("--worker_num=2", "--cluster_time_out=soon"), "numbers"),
        (("--worker_num=4",), "not a whole number of nodes"),  # msrun's local default: 8
    ],
)
def test_worker_counts_that_make_no_pods_are_refused(options: tuple[str, ...], said: str) -> None:
    _, _, problem = written(*options, "train.py")
    assert problem is not None and said in problem


def test_the_form_is_msruns_only_for_msruns_options_before_the_script() -> None:
    assert msrun_form(dashed(["--worker_num=2", "train.py"]))
    assert not msrun_form(dashed(["--nnodes=2", "train.py", "--worker_num=2"]))
    assert not msrun_form(dashed(["job.yaml"]))


def test_relaunch_run_refuses_msruns_binding_before_anything_starts() -> None:
    result = CliRunner().invoke(
        app, ["validate", "--worker_num=2", "--local_worker_num=1", "--bind_core=True", "x.py"]
    )
    assert result.exit_code == 2 and "--bind_core" in result.output


def test_the_scheduler_and_the_workers_get_msruns_variables() -> None:
    at = ("10.1.0.1", 8118)
    assert mindspore_environment(None, 0, 4, at, 600) == {
        "MS_ROLE": "MS_SCHED",
        "RANK_ID": "0",
        "RANK_SIZE": "4",
        "MS_WORKER_NUM": "4",
        "MS_SCHED_HOST": "10.1.0.1",
        "MS_SCHED_PORT": "8118",
        "MS_TOPO_TIMEOUT": "600",
    }
    worker = mindspore_environment(3, 1, 4, at, 90)
    assert (worker["MS_ROLE"], worker["MS_NODE_ID"], worker["RANK_ID"]) == ("MS_WORKER", "3", "3")
    assert (worker["DEVICE_ID"], worker["MS_TOPO_TIMEOUT"]) == ("1", "90")
