"""`procspawn run`, the launcher, as a user runs it: `python -m procspawn run ...`.

The rank scripts are written into the test's tmp_path. A rank that must be running before
the test acts writes a "ready" file holding its pid; the test waits for the files, never
for a fixed time. After the launcher exits, no rank may be left: every test checks /proc.
"""

from __future__ import annotations

import json
import os
import pty
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from _helpers import running, script_env

pytestmark = pytest.mark.timeout(120)

PATIENCE = 60.0  # seconds before a wait gives up: only a real hang gets there


def _cli(*args, cwd=None, env_extra=None, timeout=PATIENCE):
    env = script_env()
    env.pop("MASTER_PORT", None)
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, "-m", "procspawn", "run", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=cwd,
    )


def _script(tmp_path, body: str, name: str = "rank.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


# The rank side of the handshake: write "ready<rank>" (holding the pid) once running.
READY = """\
import os, sys, time
RANK = int(os.environ["RANK"])
OUT = sys.argv[1]
def ready():
    with open(os.path.join(OUT, f"ready{RANK}.tmp"), "w") as f:
        f.write(str(os.getpid()))
    os.rename(os.path.join(OUT, f"ready{RANK}.tmp"), os.path.join(OUT, f"ready{RANK}"))
def wait_for_all_ready():
    while not all(os.path.exists(os.path.join(OUT, f"ready{r}"))
                  for r in range(int(os.environ["WORLD_SIZE"]))):
        time.sleep(0.01)
"""


def _wait_ready(directory, nprocs: int, launcher=None) -> list[int]:
    """The pids of the ranks once each wrote its ready file."""
    deadline = time.monotonic() + PATIENCE
    paths = [os.path.join(directory, f"ready{r}") for r in range(nprocs)]
    while not all(os.path.exists(p) for p in paths):
        if launcher is not None and launcher.poll() is not None:
            raise AssertionError(f"the launcher exited early with {launcher.returncode}")
        assert time.monotonic() < deadline, "the ranks never became ready"
        time.sleep(0.01)
    pids = []
    for p in paths:
        with open(p) as f:
            pids.append(int(f.read()))
    return pids


def _assert_gone(pids) -> None:
    alive = [pid for pid in pids if running(pid)]
    assert not alive, f"ranks outlived the launcher: {alive}"


@pytest.fixture
def launch(tmp_path):
    """Start the launcher in the background; on the way out, nothing of it stays."""
    started: list[subprocess.Popen] = []

    def start(*args, new_session=False, stdin=subprocess.DEVNULL, extra=(), env_extra=None):
        env = script_env()
        env.pop("MASTER_PORT", None)
        env.update(env_extra or {})
        with open(tmp_path / "stdout", "wb") as out, open(tmp_path / "stderr", "wb") as err:
            proc = subprocess.Popen(
                [*extra, sys.executable, "-m", "procspawn", "run", *args],
                stdin=stdin,
                stdout=out,
                stderr=err,
                env=env,
                start_new_session=new_session,
            )
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _output(tmp_path) -> tuple[str, str]:
    return (tmp_path / "stdout").read_text(), (tmp_path / "stderr").read_text()


# -- environment and output -------------------------------------------------------------


def test_environment_and_arguments(tmp_path):
    script = _script(
        tmp_path,
        """\
        import json, os, sys
        keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "PROCSPAWN_RUN", "PROCSPAWN_START_METHOD", "PYTHONUNBUFFERED"]
        seen = {k: os.environ.get(k) for k in keys}
        seen["argv"] = sys.argv[1:]
        seen["name"] = __name__
        seen["ppid_is_launcher"] = os.getppid() == int(os.environ["LAUNCHER"])
        with open(os.path.join(os.path.dirname(__file__), f"env{seen['RANK']}.json"), "w") as f:
            json.dump(seen, f)
        """,
    )
    args = ["--x", "-n", "7", "--ranks", "all", "-m", "mod", "--", "rest"]
    code = "import os, sys\nos.environ['LAUNCHER'] = str(os.getpid())\n" + (
        "from procspawn.cli import main\nsys.exit(main(sys.argv[1:]))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, "run", "-n", "3", "--start-method", "forkserver"]
        + [script, *args],
        capture_output=True,
        text=True,
        timeout=PATIENCE,
        env={k: v for k, v in script_env().items() if k not in ("MASTER_PORT", "PYTHONUNBUFFERED")},
    )
    assert result.returncode == 0, result.stderr
    seen = [json.loads((tmp_path / f"env{r}.json").read_text()) for r in range(3)]
    ports = {s["MASTER_PORT"] for s in seen}
    assert len(ports) == 1 and 0 < int(ports.pop()) < 65536
    for rank, s in enumerate(seen):
        assert s["RANK"] == s["LOCAL_RANK"] == str(rank)
        assert s["WORLD_SIZE"] == s["LOCAL_WORLD_SIZE"] == "3"
        assert s["MASTER_ADDR"] == "127.0.0.1"
        assert s["PROCSPAWN_RUN"] == "1" and s["PROCSPAWN_START_METHOD"] == "forkserver"
        assert s["PYTHONUNBUFFERED"] == "1"
        assert s["argv"] == args  # everything after the script, untouched
        assert s["name"] == "__main__"
        assert s["ppid_is_launcher"]  # the trampoline exec'd: no process in between

    # MASTER_PORT from the environment is kept; without --start-method nothing is set
    env_extra = {"MASTER_PORT": "29555", "PYTHONUNBUFFERED": "0"}
    result = _cli(script, env_extra=env_extra | {"LAUNCHER": "0"})
    assert result.returncode == 0, result.stderr
    seen0 = json.loads((tmp_path / "env0.json").read_text())
    assert seen0["MASTER_PORT"] == "29555" and seen0["WORLD_SIZE"] == "1"
    assert seen0["PROCSPAWN_START_METHOD"] is None and seen0["PYTHONUNBUFFERED"] == "0"


def test_output_is_prefixed_per_rank(tmp_path):
    script = _script(
        tmp_path,
        """\
        import os, sys
        rank = os.environ["RANK"]
        print(f"hello from {rank}")
        print(f"warning from {rank}", file=sys.stderr)
        sys.stdout.write(f"no newline from {rank}")
        """,
    )
    result = _cli("-n", "3", script)
    assert result.returncode == 0, result.stderr
    for rank in range(3):
        assert f"[rank {rank}] hello from {rank}\n" in result.stdout
        assert f"[rank {rank}] no newline from {rank}\n" in result.stdout
        assert f"[rank {rank}] warning from {rank}\n" in result.stderr
    assert len(result.stdout.splitlines()) == 6 and len(result.stderr.splitlines()) == 3

    plain = _cli("--no-prefix", "-n", "2", script)
    assert plain.returncode == 0, plain.stderr
    assert "[rank" not in plain.stdout + plain.stderr
    assert sorted(plain.stderr.splitlines()) == ["warning from 0", "warning from 1"]


def test_ranks_filter_and_log_dir(tmp_path):
    script = _script(
        tmp_path,
        """\
        import os, sys
        rank = os.environ["RANK"]
        print(f"out {rank}")
        print(f"err {rank}", file=sys.stderr)
        """,
    )
    logs = tmp_path / "logs"
    result = _cli("-n", "3", "--ranks", "0,2", "--log-dir", str(logs), script)
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == ["[rank 0] out 0", "[rank 2] out 2"]
    assert sorted(result.stderr.splitlines()) == ["[rank 0] err 0", "[rank 2] err 2"]
    assert sorted(os.listdir(logs)) == ["rank_0.log", "rank_1.log", "rank_2.log"]
    for rank in range(3):  # every rank, both streams, no prefix
        lines = (logs / f"rank_{rank}.log").read_text().splitlines()
        assert sorted(lines) == [f"err {rank}", f"out {rank}"]


def test_module_with_dash_m(tmp_path):
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text(
        "import os, sys\nprint(__name__, os.environ['RANK'], sys.argv[1:])\n"
    )
    result = _cli("-n", "2", "-m", "mypkg.train", "--lr", "0.1", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == [
        "[rank 0] __main__ 0 ['--lr', '0.1']",
        "[rank 1] __main__ 1 ['--lr', '0.1']",
    ]
    joined = _cli("-n", "1", "-mmypkg.train", cwd=tmp_path)
    assert joined.stdout == "[rank 0] __main__ 0 []\n", joined.stderr


# -- failures ---------------------------------------------------------------------------


FAILING = READY + textwrap.dedent(
    """\
    import signal
    HOW = sys.argv[2]
    if RANK != 1 and HOW == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # only SIGKILL stops it
    ready()
    if RANK != 1:
        while True:
            time.sleep(0.05)
    wait_for_all_ready()
    print("rank 1 is about to fail", file=sys.stderr, flush=True)
    if HOW in ("raise", "stubborn"):
        def deep():
            raise ValueError("rank 1 failed on purpose")
        deep()
    if HOW == "exit":
        sys.exit(7)
    if HOW == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    """
)


@pytest.mark.parametrize(
    "how, code, summary",
    [
        ("raise", 1, "failed: exit code 1"),
        ("exit", 7, "failed: exit code 7"),
        ("sigkill", 128 + 9, "was terminated by signal SIGKILL"),
        ("stubborn", 1, "failed: exit code 1"),
    ],
)
def test_first_failure_stops_the_others(tmp_path, launch, how, code, summary):
    script = _script(tmp_path, FAILING)
    started = time.monotonic()
    proc = launch("-n", "3", "--grace-period", "1", script, str(tmp_path), how)
    pids = _wait_ready(tmp_path, 3, proc)
    assert proc.wait(timeout=PATIENCE) == code
    _assert_gone(pids)
    out, err = _output(tmp_path)
    lines = err.splitlines()
    header = f"procspawn run: rank 1 (pid {pids[1]}) {summary}"
    found = [n for n, line in enumerate(lines) if line.startswith(header)]
    assert found, err
    if how == "sigkill":  # the rank sent it itself: the kernel's OOM count did not move
        assert "not the kernel's out-of-memory killer" in lines[found[0]]
    after = lines[found[0] + 1 :]
    if how in ("raise", "stubborn"):
        # shown as it came, once; the summary names the error and where to look
        assert lines.count("[rank 1] Traceback (most recent call last):") == 1
        assert lines.count("Traceback (most recent call last):") == 0
        assert any(line.startswith("[rank 1]") and "in deep" in line for line in lines)
        assert after == [
            "rank 1 raised ValueError: rank 1 failed on purpose "
            "(its traceback is above, as [rank 1])"
        ]
    else:
        assert after == []  # no traceback to show
    if how == "stubborn":  # SIGTERM ignored: SIGKILL after the grace period
        assert time.monotonic() - started >= 1.0


def test_traceback_of_a_rank_whose_output_is_hidden(tmp_path):
    script = _script(tmp_path, "import os\nif os.environ['RANK'] == '1':\n    1 / 0\n")
    result = _cli("-n", "2", "--ranks", "0", script)
    assert result.returncode == 1
    assert "[rank 1]" not in result.stderr  # not shown as it came...
    assert "rank 1 traceback:\nTraceback (most recent call last):" in result.stderr
    assert result.stderr.endswith("ZeroDivisionError: division by zero\n")  # ...but here


# -- signals ----------------------------------------------------------------------------


GRACEFUL = READY + textwrap.dedent(
    """\
    import signal
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))
    count = 0
    def on_sigint(*args):
        global count
        count += 1
        if count == 1:
            raise KeyboardInterrupt
    signal.signal(signal.SIGINT, on_sigint)
    ready()
    try:
        while True:
            time.sleep(0.05)
    finally:
        time.sleep(float(sys.argv[2]))  # a second signal would come in this while
        with open(os.path.join(OUT, f"finally{RANK}"), "w") as f:
            f.write(str(count))
    """
)


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_to_the_launcher_goes_to_every_rank(tmp_path, launch, signum, code):
    script = _script(tmp_path, GRACEFUL)
    proc = launch("-n", "3", "--grace-period", "60", script, str(tmp_path), "0.5")
    pids = _wait_ready(tmp_path, 3, proc)
    proc.send_signal(signum)
    assert proc.wait(timeout=PATIENCE) == code
    _assert_gone(pids)
    for rank in range(3):  # every rank's finally ran
        assert (tmp_path / f"finally{rank}").exists()
    if signum == signal.SIGINT:  # sent once to each rank (by the launcher)
        assert [(tmp_path / f"finally{r}").read_text() for r in range(3)] == ["1", "1", "1"]
    assert (
        f"procspawn run: stopped every rank on {signal.Signals(signum).name}"
        in (_output(tmp_path)[1])
    )


def test_ctrl_c_in_a_terminal_reaches_each_rank_once(tmp_path, launch):
    # The terminal sends SIGINT to its whole foreground process group: the ranks get it
    # from there, and the launcher must not send it a second time.
    master, slave = pty.openpty()
    tty = os.ttyname(slave)
    os.close(slave)
    try:
        # a new session whose controlling terminal is the pty, then exec the launcher
        take_tty = (
            "import os, sys\n"
            "fd = os.open(sys.argv[1], os.O_RDWR)\n"
            "os.dup2(fd, 0)\n"
            "os.close(fd)\n"
            "os.execv(sys.argv[2], sys.argv[2:])\n"
        )
        script = _script(tmp_path, GRACEFUL)
        proc = launch(
            "-n", "2", "--grace-period", "60", script, str(tmp_path), "1.0",
            new_session=True, extra=[sys.executable, "-c", take_tty, tty],
        )  # fmt: skip
        pids = _wait_ready(tmp_path, 2, proc)
        os.write(master, b"\x03")  # Ctrl-C
        assert proc.wait(timeout=PATIENCE) == 130
        _assert_gone(pids)
        assert [(tmp_path / f"finally{r}").read_text() for r in range(2)] == ["1", "1"]
    finally:
        os.close(master)


def test_ranks_die_with_a_killed_launcher(tmp_path, launch):
    # SIGKILL leaves the launcher no chance: the kernel's parent-death signal stops them
    script = _script(tmp_path, READY + "ready()\nwhile True:\n    time.sleep(0.05)\n")
    proc = launch("-n", "3", script, str(tmp_path))
    pids = _wait_ready(tmp_path, 3, proc)
    proc.kill()
    proc.wait(timeout=PATIENCE)
    deadline = time.monotonic() + PATIENCE
    left = set(pids)
    while left and time.monotonic() < deadline:
        for pid in list(left):
            if not running(pid):
                left.discard(pid)
                try:  # reparented to this test process (a subreaper): reap it
                    os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    pass
        time.sleep(0.01)
    _assert_gone(pids)


def test_success_leaves_nothing(tmp_path, launch):
    script = _script(tmp_path, READY + "ready()\nwait_for_all_ready()\nprint('done')\n")
    proc = launch("-n", "4", script, str(tmp_path))
    pids = _wait_ready(tmp_path, 4, proc)
    assert proc.wait(timeout=PATIENCE) == 0
    _assert_gone(pids)
    out, err = _output(tmp_path)
    assert sorted(out.splitlines()) == [f"[rank {r}] done" for r in range(4)]
    assert err == ""


# -- usage ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, message",
    [
        (["-n", "0", "{script}"], "-n must be >= 1"),
        (["-n", "two", "{script}"], "invalid int value"),
        (["-n", "2", "missing.py"], "no such script: 'missing.py'"),
        (["-n", "2", "--frobnicate", "{script}"], "unrecognized arguments: --frobnicate"),
        (["-n", "2", "--grace", "1", "{script}"], "unrecognized arguments: --grace"),
        (["-n", "2", "--ranks", "5", "{script}"], "there is no rank 5 among 2"),
        (["-n", "2", "--ranks", "x", "{script}"], "--ranks takes rank numbers"),
        (["-n", "2", "--grace-period", "-1", "{script}"], "--grace-period must be >= 0"),
        (["-n", "2", "--start-method", "teleport", "{script}"], "is not a start method"),
        (["--log-dir", "{script}", "{script}"], "is not a directory that can be made"),
        (["-n", "2"], "give the script to run"),
        (["-n", "2", "-m"], "-m needs a module name"),
        (["-n", "2", "-m", "no_such_module_here"], "no module named 'no_such_module_here'"),
    ],
)
def test_bad_usage_exits_2(tmp_path, args, message):
    script = _script(tmp_path, "print('must not run')\n")
    result = _cli(*[a.format(script=script) for a in args], cwd=tmp_path)
    assert result.returncode == 2
    assert result.stdout == ""
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert result.stderr.startswith("procspawn run: error: ")
    assert message in result.stderr


def test_bad_grace_period_in_the_environment(tmp_path):
    script = _script(tmp_path, "print('must not run')\n")
    result = _cli(script, env_extra={"PROCSPAWN_GRACE_PERIOD": "soon"})
    assert result.returncode == 2
    assert "PROCSPAWN_GRACE_PERIOD='soon' is not valid: use a number of seconds" in result.stderr


def test_help(tmp_path):
    result = _cli("--help")
    assert result.returncode == 0
    assert "RANK, LOCAL_RANK, WORLD_SIZE" in result.stdout and "``" not in result.stdout
    assert "the start method procspawn.spawn uses inside the ranks" in result.stdout
