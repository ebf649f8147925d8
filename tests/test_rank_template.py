"""A pod's rank template (relaunch._template, launcher/template.py): the ranks it forks are the
processes the launcher would have started (command line, sys.argv, sys.path, __main__,
environment, working directory, session, cgroup, log, exit code), with the heavy imports done
once in the template; without a template, or once it is gone, ranks start as new processes.

A stand-in `torch` (a module on PYTHONPATH that records which process imported it) keeps these
tests fast; the whole ladder on the real torch is every real test of a torch example (each pod's
ranks are forked from its template), and tests/test_gpus.py runs one on a GPU."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from relaunch.containers import ClusterCgroups
from relaunch.launcher.ranks import INJECT_DIR
from relaunch.launcher.template import Forked, RankTemplate, imports_torch, template_argv

STAND_IN_TORCH = "import os\nimported_by = os.getpid()\n"

RANK_SCRIPT = """\
import json, os, sys
import torch
code = int(os.environ.get("EXIT_WITH", "0"))
print(json.dumps({
    "argv": sys.argv, "path0": sys.path[0], "name": __name__, "cwd": os.getcwd(),
    "rank": os.environ.get("RANK"), "template_env": os.environ.get("RELAUNCH_RANK_TEMPLATE"),
    "torch_imported_by": torch.imported_by, "pid": os.getpid(),
    "session_leader": os.getsid(0) == os.getpid(), "cgroup": open("/proc/self/cgroup").read(),
    "stdin": sys.stdin.read(),
    "proc_environ": sorted(
        e.decode() for e in open("/proc/self/environ", "rb").read().split(b"\\0") if e
    ),
}), flush=True)
if os.environ.get("SLEEP"):
    import time; time.sleep(float(os.environ["SLEEP"]))
sys.exit(code)
"""


def _pod(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "torch.py").write_text(STAND_IN_TORCH)
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "train.py").write_text(RANK_SCRIPT)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join((str(INJECT_DIR), str(tmp_path / "lib"))),
        "RELAUNCH_INJECT_DIR": str(tmp_path),
        "RELAUNCH_SPARE_PRELOAD": "torch",
        "PYTHONUNBUFFERED": "1",
        # `python` is the Python relaunch runs on, as in every pod's environment
        "PATH": os.pathsep.join((str(Path(sys.executable).parent), os.environ["PATH"])),
    }
    env.pop("RELAUNCH_RANK_TEMPLATE", None)
    return tmp_path / "job", env


def _said(log: Path) -> dict[str, object]:
    lines = [line for line in log.read_text().splitlines() if line.startswith("{")]
    assert len(lines) == 1, log.read_text()
    found: dict[str, object] = json.loads(lines[0])
    return found


COMMAND = ("/bin/sh", "-c", "python train.py --steps 3")


@pytest.fixture
def pod(tmp_path: Path) -> Iterator[tuple[RankTemplate, Path, dict[str, str]]]:
    """A started template of the job's command, its working directory and environment."""
    cwd, env = _pod(tmp_path)
    template = RankTemplate(COMMAND)
    template.start(cwd, env)
    try:
        yield template, cwd, env
    finally:
        template.retire()


def test_a_forked_rank_is_the_process_a_new_one_would_be_with_torch_imported_once(
    tmp_path: Path, pod: tuple[RankTemplate, Path, dict[str, str]]
) -> None:
    template, cwd, env = pod
    ranks = []
    for rank in (0, 1):
        log = tmp_path / f"rank-{rank}.log"
        log.write_text("--- an earlier attempt's lines stay ---\n")
        forked = template.fork({**env, "RANK": str(rank)}, str(cwd), str(log), None)
        assert isinstance(forked, Forked)
        ranks.append((forked, log))
    for forked, _ in ranks:
        assert forked.wait(timeout=30) == 0
    # the same command run as a new process, as a rank starts without a template
    cold_log = tmp_path / "cold.log"
    with open(cold_log, "ab") as out:
        subprocess.run(
            ["python", "train.py", "--steps", "3"], cwd=cwd, check=True, stdout=out,
            env={**env, "RANK": "0"},
            stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
    cold = _said(cold_log)
    assert template.proc is not None
    for rank, (forked, log) in enumerate(ranks):
        assert log.read_text().startswith("--- an earlier attempt's lines stay ---\n")
        said = _said(log)
        for same in ("argv", "path0", "name", "cwd", "stdin", "session_leader"):
            assert said[same] == cold[same], same
        assert said["rank"] == str(rank) and said["pid"] == forked.pid
        assert said["template_env"] is None  # the rank's environment, not the template's
        # and what /proc/PID/environ shows of it (ps, psutil, a monitoring agent read it there)
        assert said["proc_environ"] == sorted(
            f"{k}={v}" for k, v in {**env, "RANK": str(rank)}.items()
        )
        assert said["torch_imported_by"] == template.proc.pid  # once, in the template
    assert cold["torch_imported_by"] == cold["pid"] and cold["session_leader"] is True


def test_a_forked_ranks_exit_code_and_signal_are_its_own(
    tmp_path: Path, pod: tuple[RankTemplate, Path, dict[str, str]]
) -> None:
    template, cwd, env = pod
    failed = template.fork({**env, "EXIT_WITH": "3"}, str(cwd), str(tmp_path / "a"), None)
    sleeping = template.fork({**env, "SLEEP": "60"}, str(cwd), str(tmp_path / "b"), None)
    assert failed is not None and sleeping is not None
    assert failed.wait(timeout=30) == 3
    assert sleeping.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        sleeping.wait(timeout=0.2)
    os.killpg(sleeping.pid, signal.SIGKILL)  # its own process group, as a new process's
    assert sleeping.wait(timeout=30) == -signal.SIGKILL


def test_the_ranks_die_with_their_template_and_the_next_starts_as_a_new_process(
    tmp_path: Path, pod: tuple[RankTemplate, Path, dict[str, str]]
) -> None:
    template, cwd, env = pod
    rank = template.fork({**env, "SLEEP": "60"}, str(cwd), str(tmp_path / "a"), None)
    assert rank is not None and rank.poll() is None
    assert template.proc is not None
    template.proc.kill()
    assert rank.wait(timeout=30) == -signal.SIGKILL  # PR_SET_PDEATHSIG: nothing outlives it
    deadline = time.monotonic() + 30
    while template.usable() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not template.usable()
    assert template.fork(env, str(cwd), str(tmp_path / "b"), None) is None


def test_a_forked_rank_joins_its_cgroup_before_its_script_runs(tmp_path: Path) -> None:
    """Made again where it went meanwhile (the last process of a cluster removes the empty
    cgroups), as a new process's is: a standby pod's rank once found its cgroup gone."""
    probed = ClusterCgroups.probe(tmp_path / "state")
    if isinstance(probed, str):
        pytest.skip(f"needs a cgroup v2 this test may create (root): {probed}")
    cwd, env = _pod(tmp_path)
    pod = probed.pod("node-0", 1, 0, 1)
    template = RankTemplate(COMMAND, container=pod.child("spares"))
    template.start(cwd, env)
    rank_cgroup = pod.child("rank-0")
    rank_cgroup.make()
    rank_cgroup.path.rmdir()  # gone between the launcher's make and the rank's join
    try:
        rank = template.fork(env, str(cwd), str(tmp_path / "a"), rank_cgroup)
        assert rank is not None and rank.wait(timeout=30) == 0
        assert template.proc is not None and template.proc.pid in pod.child("spares").procs()
    finally:
        template.retire()
        probed.shutdown()
    cgroup_line = str(_said(tmp_path / "a")["cgroup"])
    assert cgroup_line.rstrip().endswith(str(rank_cgroup.path).split("/relaunch-", 1)[1])


def test_which_commands_get_a_template(tmp_path: Path) -> None:
    (tmp_path / "uses_torch.py").write_text("def f():\n    from torch import nn\n")
    (tmp_path / "uses_lightning.py").write_text("import lightning.pytorch as pl\n")
    (tmp_path / "plain.py").write_text("import json, time\nfrom .torch import x\n")
    (tmp_path / "broken.py").write_text("import torch(\n")
    assert imports_torch(tmp_path / "uses_torch.py")
    assert imports_torch(tmp_path / "uses_lightning.py")
    assert not imports_torch(tmp_path / "plain.py")  # a relative `.torch` is the job's own
    assert not imports_torch(tmp_path / "broken.py")
    assert not imports_torch(tmp_path / "missing.py")
    shell = ["/bin/sh", "-c"]
    assert template_argv([*shell, "python uses_torch.py --lr 1"], tmp_path) == [
        "python", "uses_torch.py", "--lr", "1",
    ]  # fmt: skip
    assert template_argv(["python3", str(tmp_path / "uses_torch.py")], Path("/")) is not None
    assert template_argv([*shell, "python plain.py"], tmp_path) is None  # nothing to import
    assert template_argv([*shell, "python uses_torch.py | tee log"], tmp_path) is None
    assert template_argv([*shell, "torchrun uses_torch.py"], tmp_path) is None
    assert template_argv(["python", "-m", "uses_torch"], tmp_path) is None


def test_a_job_that_turns_the_template_off_starts_no_template(tmp_path: Path) -> None:
    cwd, env = _pod(tmp_path)
    template = RankTemplate(COMMAND)
    template.start(cwd, {**env, "RELAUNCH_RANK_TEMPLATE": "0"})
    assert template.proc is None and not template.usable()
    assert template.fork(env, str(cwd), str(tmp_path / "a"), None) is None


def test_a_rank_is_forked_from_a_ready_template_not_kept_waiting_for_a_spare_still_importing(
    tmp_path: Path,
    pod: tuple[RankTemplate, Path, dict[str, str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fault moments after a refill: the pool's one spare is importing (its gate shut), the
    template is ready. The rank is forked from the template at once; the spare is not waited
    for (a wait hurries it to the launcher's priority first). Without a template the rank waits
    for that spare, the quickest left."""
    import threading

    from relaunch.launcher import spares as spares_module
    from relaunch.launcher.ranks import rank_source
    from relaunch.launcher.spares import SparePool

    template, cwd, env = pod
    assert template.ready.wait(timeout=60)
    gate = tmp_path / "gate"
    (tmp_path / "lib" / "slow_import.py").write_text(
        "import pathlib, time\n"
        f"while not pathlib.Path({str(gate)!r}).exists():\n"
        "    time.sleep(0.01)\n"
    )
    hurried: list[int] = []
    real_hurry = spares_module._hurry
    monkeypatch.setattr(
        spares_module, "_hurry", lambda spare: (hurried.append(spare.proc.pid), real_hurry(spare))
    )
    pool = SparePool(1, COMMAND)
    pool.refill(cwd, {**env, "RELAUNCH_SPARE_PRELOAD": "slow_import"})
    (importing,) = pool.spares
    try:
        assert rank_source(pool, template, None) == (None, template)
        assert hurried == [] and pool.spares == [importing]
        assert not importing.ready.is_set()
        opener = threading.Timer(0.3, gate.write_text, args=("open",))
        opener.start()
        try:
            without_template = RankTemplate(("/bin/sh", "-c", "exit 0"))  # never started
            assert rank_source(pool, without_template, None) == (importing, None)
        finally:
            opener.join()
        assert hurried and set(hurried) == {importing.proc.pid}
    finally:
        pool.retire()
        importing.proc.kill()
        importing.proc.wait()
