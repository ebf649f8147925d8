"""A pod is a real container (a cgroup v2): nothing a rank starts outlives its pod.

The rank script below is written as a user writes one: it starts helpers the way log shippers
and prefetch daemons do (`setsid -f`, a new session from Python), and each helper writes its pid
to a file, so that the test can tell whether it still runs. Needs root (or a delegated cgroup)
for the cgroup tests; where no cgroup can be made they skip and say why.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from relaunch.containers import (
    Cgroup,
    ClusterCgroups,
    cluster_root,
    own_cgroup,
    reap_pods,
    unified_mount,
)
from tests.runtime import FAST_CLUSTER, ROOT, UNCONDITIONAL, Cluster, toy_job, wait_gone

HELPERS_RANK = r"""
import os, re, subprocess, sys, time
from relaunch.train import report_progress
marks, steps = sys.argv[1], int(sys.argv[2])
tag = f"{os.environ['RANK']}-s{os.environ['MA_SCHEDULE_CNT']}-p{os.environ['MA_PROC_START_CNT']}"
helper = ["bash", "-c", 'echo $$ > "$0.tmp"; mv "$0.tmp" "$0"; exec -a test-helper sleep 600']
# a daemon that leaves the process group (setsid forks: a double fork) and one that leaves the
# session from Python, as a log shipper or a `nohup` tool would
subprocess.run(["setsid", "-f", *helper, f"{marks}/helper-setsid-{tag}"], check=True)
subprocess.Popen([*helper, f"{marks}/helper-session-{tag}"], start_new_session=True)
time.sleep(0.5)
alive = []  # helpers of an earlier schedule of the job (any rank) that still run
schedule = int(os.environ["MA_SCHEDULE_CNT"])
for name in os.listdir(marks):
    found = re.fullmatch(r"helper-\w+-\d+-s(\d+)-p\d+", name)
    if found and int(found[1]) < schedule:
        pid = int(open(os.path.join(marks, name)).read() or 0)
        try:
            if "helper" in open(f"/proc/{pid}/cmdline").read():
                alive.append(name)
        except OSError:
            pass
if alive:
    open(os.path.join(marks, f"survivors-seen-by-{tag}"), "w").write(" ".join(alive))
for step in range(1, steps + 1):
    report_progress(step)
    time.sleep(0.05)
"""


def _cgroups_or_skip(state: Path) -> ClusterCgroups:
    probed = ClusterCgroups.probe(state)
    if isinstance(probed, str):
        pytest.skip(f"needs a cgroup v2 this test may create (root): {probed}")
    return probed


def helpers_job(marks: Path, steps: int, wrapper: bool = False, **spec: Any) -> dict[str, Any]:
    job = toy_job(UNCONDITIONAL, **spec)
    script = marks.parent / "rank.py"
    script.write_text(HELPERS_RANK)
    command = f"{sys.executable} {script} {marks} {steps}"
    # a wrapper shell whose child is the Python: the child is not the launcher's own child
    job["spec"]["command"] = ["bash", "-c", f"{command}; exit $?"] if wrapper else command.split()
    return job


def live_helpers(marks: Path) -> list[str]:
    """The helpers whose process still runs (pid file, and the pid is still a helper's)."""
    alive = []
    for path in marks.glob("helper-*[0-9]"):
        if path.suffix == ".tmp":
            continue
        text = path.read_text()
        if not text:
            continue
        try:
            if "helper" in " ".join(psutil.Process(int(text)).cmdline()):
                alive.append(path.name)
        except psutil.NoSuchProcess:
            continue
    return alive


def kill_helpers(marks: Path) -> None:
    for path in marks.glob("helper-*[0-9]"):
        if path.suffix == ".tmp":
            continue
        try:
            process = psutil.Process(int(path.read_text() or 0))
            if "helper" in " ".join(process.cmdline()):
                process.kill()
        except (psutil.Error, ValueError):
            continue


@pytest.fixture
def marks(cluster: Cluster) -> Any:
    path = cluster.dir / "marks"
    path.mkdir()
    yield path
    kill_helpers(path)  # what a failed test left, so that the next one starts clean


def test_unified_hierarchy_is_found_in_mountinfo_not_assumed() -> None:
    mountinfo = (
        "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
        "32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu\n"
        "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n"
    )
    assert unified_mount(mountinfo) == Path("/sys/fs/cgroup/unified")
    assert unified_mount("30 1 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n") == Path(
        "/sys/fs/cgroup"
    )
    assert unified_mount("32 31 0:29 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n") is None
    assert own_cgroup("4:memory:/x\n0::/user.slice/session-1.scope\n") == (
        "/user.slice/session-1.scope"
    )
    assert own_cgroup("4:memory:/x\n") == "/"


def test_no_cgroups_on_purpose_is_said_and_the_probe_makes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RELAUNCH_CGROUPS", "off")
    assert ClusterCgroups.probe(tmp_path) == "RELAUNCH_CGROUPS=off"


def test_probing_and_the_last_process_out_leave_no_cgroup(tmp_path: Path) -> None:
    """A probe (every engine makes one) leaves nothing; the last process of a cluster to exit
    removes every empty cgroup, a lost node's too, and a process that joins a cgroup removed
    meanwhile gets it made again."""
    cluster = _cgroups_or_skip(tmp_path)
    assert not cluster.root.path.exists()
    cluster.node("lost").make()  # a node lost: killed, its directory left
    agent = cluster.agent("alive").make()
    last = subprocess.Popen(
        [sys.executable, "-c", "import sys; from relaunch.containers import Cgroup, step_out;"
         " step_out(Cgroup(__import__('pathlib').Path(sys.argv[1])), levels=1)", str(agent.path)],
        preexec_fn=agent.join,
    )  # fmt: skip
    assert last.wait(30) == 0
    assert not cluster.root.path.exists()
    pod = cluster.pod("n", 1, 0, 1)
    sleeper = subprocess.Popen(["sleep", "30"], preexec_fn=pod.child("rank-0").join)
    try:
        assert sleeper.pid in pod.procs()
    finally:
        sleeper.kill()
        sleeper.wait()
        cluster.shutdown()


def test_a_cgroup_kill_takes_what_left_the_process_group(tmp_path: Path) -> None:
    cluster = _cgroups_or_skip(tmp_path)
    pod = cluster.pod("node-0", 1, 0, 1).make()
    rank = pod.child("rank-0").make()
    pid_file = tmp_path / "daemon.pid"
    code = "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(60)"
    shell = subprocess.Popen(
        ["setsid", "-f", sys.executable, "-c", code, str(pid_file)], preexec_fn=rank.join
    )
    shell.wait(5)
    deadline = time.monotonic() + 10
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    daemon = psutil.Process(int(pid_file.read_text()))
    assert os.getsid(daemon.pid) != os.getsid(0), "the daemon left our session"
    assert daemon.pid in pod.procs() and rank.populated()
    # what a count of left-behind processes is, named: its cgroup, its name, its state
    name = psutil.Process(daemon.pid).name()
    assert cluster.root.census() == [f"node-node-0/job-1-pod-0-g1/rank-0: {name} (S)"]
    assert cluster.shutdown() == 1
    daemon.wait(5)
    assert not cluster.root.path.exists()


def test_a_cgroup_removed_while_a_process_joins_it_is_made_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last process of a cluster removes its empty cgroups; one can go between the open of
    its cgroup.procs and the write, which the kernel answers with ENODEV (removed here at that
    moment, for real). Seen in the suite: a launcher's start failed ("Exception occurred in
    preexec_fn") and took the controller down with it."""
    import builtins

    import relaunch.containers as containers

    cluster = _cgroups_or_skip(tmp_path)
    target = cluster.pod("node-0", 1, 0, 1).child("launcher").make()
    removed: list[str] = []

    def open_then_remove(path: Any, *args: Any, **kwargs: Any) -> Any:
        opened = builtins.open(path, *args, **kwargs)  # noqa: SIM115 (the caller closes it)
        if not removed and str(path).endswith("cgroup.procs"):
            os.rmdir(Path(path).parent)
            removed.append(str(path))
        return opened

    monkeypatch.setattr(containers, "open", open_then_remove, raising=False)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        target.add(sleeper.pid)
        assert removed, "the cgroup was not removed under the join"
        assert sleeper.pid in target.procs()
    finally:
        sleeper.kill()
        sleeper.wait()
        cluster.shutdown()


def test_an_agent_reaps_a_pod_whose_launcher_died_and_leaves_a_starting_one(
    tmp_path: Path,
) -> None:
    cluster = _cgroups_or_skip(tmp_path)
    try:
        starting = cluster.pod("n", 1, 1, 1).make()
        starting.child("launcher").make()
        dead = cluster.pod("n", 1, 0, 1).make()
        launcher = subprocess.Popen(["sleep", "60"], preexec_fn=dead.child("launcher").make().join)
        rank = subprocess.Popen(["sleep", "60"], preexec_fn=dead.child("rank-0").make().join)
        seen: set[Path] = set()
        assert reap_pods(cluster, "n", seen) == 0 and seen == {dead.path}
        launcher.kill()
        launcher.wait()
        assert reap_pods(cluster, "n", seen) == 1
        assert rank.wait(5) == -signal.SIGKILL
        assert not dead.path.exists() and starting.path.exists()
    finally:
        cluster.shutdown()


def test_helpers_that_leave_the_process_group_end_with_a_job_level_restart_and_the_job(
    cluster: Cluster, marks: Path
) -> None:
    _cgroups_or_skip(cluster.state)
    faults = [{"kind": "process-exit", "at_step": 10, "pod": 1}]
    result = cluster.run(helpers_job(marks, steps=60), faults)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.actions == ["job-reschedule"]
    assert "pods are cgroups" in result.stdout
    # the restarted ranks found none of the first attempt's helpers still running
    assert not list(marks.glob("survivors-seen-by-*")), [
        p.read_text() for p in marks.glob("survivors-*")
    ]
    assert len(list(marks.glob("helper-*[0-9]"))) == 16  # 2 helpers x 4 ranks x 2 attempts
    assert live_helpers(marks) == []
    assert result.report["left_behind"] == 0, result.stdout


def test_helpers_end_with_an_abandoned_run(cluster: Cluster, marks: Path) -> None:
    _cgroups_or_skip(cluster.state)
    adopt_s = float(FAST_CLUSTER["adopt_grace_s"])
    run = subprocess.Popen(
        cluster.command(helpers_job(marks, steps=100000)),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while len(list(marks.glob("helper-*[0-9]"))) < 8:
            assert run.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        run.send_signal(signal.SIGKILL)
        run.wait()
    assert len(live_helpers(marks)) == 8
    deadline = time.monotonic() + 2 * adopt_s + 5
    while live_helpers(marks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert live_helpers(marks) == []  # before: 2 to 8 helpers ran on
    assert not wait_gone(cluster.state, timeout=2)
    root = cluster_root(cluster.state)
    assert root is not None and not root.path.exists(), "the last process out removed the cgroups"


def test_a_killed_launcher_takes_its_pod_with_it(cluster: Cluster, marks: Path) -> None:
    """The ranks run under a `bash -c` wrapper: the Python is the wrapper's child, in the rank's
    process group but not the launcher's child, and ran on after its launcher was SIGKILLed."""
    _cgroups_or_skip(cluster.state)
    run = subprocess.Popen(
        cluster.command(helpers_job(marks, steps=150, wrapper=True)),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not {"helper-setsid-2-s1-p1", "helper-session-3-s1-p1"} <= {
            p.name for p in marks.glob("helper-*[0-9]")
        }:
            assert run.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        launchers = json.loads((cluster.state / "pids.json").read_text())["launchers"]
        pid = next(ref[0] for key, ref in launchers.items() if key.startswith("1/1/1/"))
        pythons = [
            p
            for p in psutil.Process(pid).children(recursive=True)
            if p.name().startswith("python") and "rank.py" in " ".join(p.cmdline())
        ]
        assert len(pythons) == 2, "the wrapped Pythons of pod 1"
        os.kill(pid, signal.SIGKILL)
        _, gone_not = psutil.wait_procs(pythons, timeout=10)
        assert not gone_not, "the pod's ranks outlived their launcher"
        stdout, stderr = run.communicate(timeout=120)
    finally:
        run.kill()
    assert run.returncode == 0, stdout + stderr
    report = json.loads((cluster.dir / "report.json").read_text())
    assert [r["action"] for r in report["recoveries"]] == ["job-reschedule"]
    assert live_helpers(marks) == []
    assert report["left_behind"] == 0


def test_without_cgroups_pods_are_process_groups_and_it_is_said_once(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fallback (no cgroups here, or RELAUNCH_CGROUPS=off): ranks are process groups, the
    job recovers as before, nothing of the ranks' own processes is left, and the start says
    that a helper leaving its process group could outlive its pod."""
    monkeypatch.setenv("RELAUNCH_CGROUPS", "off")
    faults = [{"kind": "process-exit", "at_step": 10, "pod": 1}]
    result = cluster.run(toy_job(UNCONDITIONAL, steps=40), faults)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.actions == ["job-reschedule"]
    said = [line for line in result.stdout.splitlines() if "process groups, not cgroups" in line]
    assert len(said) == 1 and "RELAUNCH_CGROUPS=off" in said[0], result.stdout
    assert result.report["left_behind"] is None
    root = cluster_root(cluster.state)
    assert root is None or not root.path.exists(), "no cgroup was made"


def test_cgroup_is_gone_after_the_job(cluster: Cluster) -> None:
    groups = _cgroups_or_skip(cluster.state)
    result = cluster.run(toy_job(UNCONDITIONAL, steps=20))
    assert result.returncode == 0, result.stdout + result.stderr
    assert not groups.root.path.exists()
    assert Cgroup(groups.root.path).procs() == []


def test_cgroups_are_found_in_a_network_namespace_whose_sys_hides_them(tmp_path: Path) -> None:
    """`ip netns exec` (how a node of the Ray trial cluster runs) mounts a fresh /sys, hiding
    /sys/fs/cgroup: as root there relaunch mounts the one hierarchy itself, privately; a
    machine whose cgroups are v1 only is left as it is."""
    from relaunch.containers import _sys_remounted

    assert _sys_remounted("45 40 0:22 / /sys rw - sysfs sysfs rw\n")
    assert not _sys_remounted("32 31 0:29 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n")
    _cgroups_or_skip(tmp_path)
    namespace = f"relaunch-test-{os.getpid()}"
    if subprocess.run(["ip", "netns", "add", namespace], capture_output=True).returncode != 0:
        pytest.skip("needs root and iproute2 to make a network namespace")
    try:
        probe = (
            "from pathlib import Path; from relaunch.containers import ClusterCgroups\n"
            f"found = ClusterCgroups.probe(Path({str(tmp_path)!r}))\n"
            "print(found if isinstance(found, str) else found.root.path)\n"
        )
        done = subprocess.run(
            ["ip", "netns", "exec", namespace, sys.executable, "-c", probe],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("/run/relaunch/cgroup2/relaunch-"), done.stdout
    finally:
        subprocess.run(["ip", "netns", "del", namespace], check=False)
    assert not Path("/run/relaunch/cgroup2/cgroup.procs").exists(), "mounted outside it"


def test_left_behind_an_agent_in_its_exit_is_killed_and_waited_not_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 49's `left_behind: 1` ("node-node-0/agent: python (R)", 3 of 19 demo runs, likelier
    on a busy machine): at the job's end a node's agent was still in its exit. The kernel had
    released its memory, so its command line read empty; the cluster took it for another's
    process (its pid and start time were the remembered ones), neither killed nor waited for
    it, and the census then found it running in its cgroup. Here the agent's command line reads
    empty as it does then: it is still the cluster's own, killed, waited for, not counted."""
    from relaunch.cluster.local import LocalCluster

    cluster = LocalCluster(tmp_path)
    if cluster.cgroups is None:
        pytest.skip(f"needs a cgroup v2 this test may create (root): {cluster.no_cgroups_because}")
    placement, _ = cluster.cgroups.agent_placement("node-0")
    agent = subprocess.Popen(["sleep", "60"], preexec_fn=placement.join)
    try:
        cluster._remember("agents", "node-0", agent.pid)
        monkeypatch.setattr(psutil.Process, "cmdline", lambda self: [])
        left = cluster.shutdown()
        assert not psutil.pid_exists(agent.pid)  # killed, and reaped by the wait for it
        assert left.count == 0, left.what
    finally:
        agent.kill()
        agent.wait()


def test_left_behind_counts_what_lives_on_not_what_ends_on_its_own(tmp_path: Path) -> None:
    """The census names a process that lives on in a pod's cgroup; one that ends within the
    settle time (in its exit as the count is taken), and the processes the caller ends itself,
    are not left behind."""
    cluster = _cgroups_or_skip(tmp_path)
    rank = cluster.pod("node-0", 1, 0, 1).make().child("rank-0").make()
    lives = subprocess.Popen(["sleep", "60"], preexec_fn=rank.join)
    ending = subprocess.Popen(["sleep", "0.2"], preexec_fn=rank.join)
    own = subprocess.Popen(["sleep", "60"], preexec_fn=rank.join)
    try:
        found = cluster.root.census(besides={own.pid}, settle_s=5.0)
        assert found == ["node-node-0/job-1-pod-0-g1/rank-0: sleep (S)"], found
        assert ending.poll() is not None  # it ended (a zombie until reaped: not listed)
    finally:
        for process in (lives, ending, own):
            process.kill()
            process.wait()
        cluster.shutdown()


_PROBES = r"""
import sys
from pathlib import Path
from relaunch.containers import ClusterCgroups
said = [ClusterCgroups.probe(Path(sys.argv[1])) for _ in range(int(sys.argv[2]))]
print(sum(isinstance(s, str) for s in said), [s for s in said if isinstance(s, str)][:1])
"""


def test_node_hosts_probing_cgroups_at_once_all_find_them(tmp_path: Path) -> None:
    """The node hosts of a Ray trial cluster are processes on one machine that probe the
    cluster's cgroups at the same moment: every one finds them. Before: one's cleanup removed
    the cluster's cgroup with another's probe in it, which then found no cgroup.kill and ran its
    pods as process groups."""
    _cgroups_or_skip(tmp_path / "state")
    probers = [
        subprocess.Popen(
            [sys.executable, "-c", _PROBES, str(tmp_path / "state"), "40"],
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    said = [p.communicate(timeout=120)[0].strip() for p in probers]
    assert all(line.startswith("0 ") for line in said), said
