"""The output forwarder: ranks' pipes to this process' streams, log files and tails.

Most tests write into the pipes themselves (the test plays the rank), so what arrives and
when is under the test's control; a few use real child processes. Every wait is on
something the forwarder does (text reaching the sink, bytes reaching a log file, EOF).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from _helpers import run_script

from procspawn._output import FLUSH_AFTER, OutputForwarder

pytestmark = pytest.mark.timeout(60)

PATIENCE = 20.0  # seconds before a wait gives up: only a real hang gets there


class Sink:
    """Stands in for sys.stdout / sys.stderr and lets a test wait for text."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.parts: list[str] = []

    def write(self, text: str) -> int:
        with self._cond:
            self.parts.append(text)
            self._cond.notify_all()
        return len(text)

    def flush(self) -> None:
        pass

    @property
    def text(self) -> str:
        with self._cond:
            return "".join(self.parts)

    def wait_for(self, needle: str) -> str:
        with self._cond:
            ok = self._cond.wait_for(lambda: needle in "".join(self.parts), PATIENCE)
            text = "".join(self.parts)
        assert ok, f"{needle!r} never arrived; got {text!r}"
        return text


def _sink(monkeypatch, name: str = "stdout") -> Sink:
    # In the test body: pytest's capture sets sys.stdout again when the test starts, so a
    # fixture's replacement would not last.
    sink = Sink()
    monkeypatch.setattr(sys, name, sink)
    return sink


def _wait_file(path, content: bytes) -> None:
    deadline = time.monotonic() + PATIENCE
    while time.monotonic() < deadline:
        if os.path.exists(path):
            with open(path, "rb") as f:
                if f.read() == content:
                    return
        time.sleep(0.01)
    with open(path, "rb") as f:
        assert f.read() == content


def _write(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data) :]


def test_prefixed_lines(monkeypatch):
    out = _sink(monkeypatch)
    err = _sink(monkeypatch, "stderr")
    fw = OutputForwarder(prefix=True)
    w0, w1, e0 = fw.pipe(0, "stdout"), fw.pipe(1, "stdout"), fw.pipe(0, "stderr")
    _write(w0, b"one\ntwo\n")
    _write(w1, b"three\n")
    _write(e0, b"oops\n")
    for fd in (w0, w1, e0):
        os.close(fd)
    assert fw.wait_eof(0, PATIENCE) and fw.wait_eof(1, PATIENCE)
    fw.close()
    assert sorted(out.text.splitlines()) == ["[rank 0] one", "[rank 0] two", "[rank 1] three"]
    assert err.text == "[rank 0] oops\n"


def test_a_line_is_held_until_its_newline(monkeypatch):
    out = _sink(monkeypatch)
    fw = OutputForwarder(prefix=True)
    w0 = fw.pipe(0, "stdout")
    try:
        _write(w0, b"abc")
        # whatever comes after a partial line waits for it, so "abc" is not shown yet
        # unless FLUSH_AFTER has already passed (then it is shown whole, prefixed)
        _write(w0, b"def\n")
        out.wait_for("\n")
        assert out.text == "[rank 0] abcdef\n"
    finally:
        os.close(w0)
        fw.close()


def test_a_partial_line_is_shown_after_a_while_and_continued(monkeypatch):
    out = _sink(monkeypatch)
    fw = OutputForwarder(prefix=True)
    w0 = fw.pipe(0, "stdout")
    try:
        started = time.monotonic()
        _write(w0, b"password: ")
        out.wait_for("[rank 0] password: ")
        assert time.monotonic() - started >= FLUSH_AFTER * 0.9
        _write(w0, b"ok\n")
        out.wait_for("ok\n")
        assert out.text == "[rank 0] password: ok\n"
    finally:
        os.close(w0)
        fw.close()


def test_other_output_starts_on_a_line_of_its_own(monkeypatch):
    out = _sink(monkeypatch)
    fw = OutputForwarder(prefix=True)
    w0, w1 = fw.pipe(0, "stdout"), fw.pipe(1, "stdout")
    try:
        _write(w0, b"continue? ")
        out.wait_for("continue? ")
        _write(w1, b"rank one\n")
        out.wait_for("rank one\n")
        _write(w0, b"yes\n")
        out.wait_for("yes\n")
        assert out.text == "[rank 0] continue? \n[rank 1] rank one\n[rank 0] yes\n"
    finally:
        os.close(w0)
        os.close(w1)
        fw.close()


def test_a_partial_last_line_gets_a_newline(monkeypatch):
    out = _sink(monkeypatch)
    for prefix, expected in ((True, "[rank 3] last words\n"), (False, "last words\n")):
        fw = OutputForwarder(prefix=prefix)
        w = fw.pipe(3, "stdout")
        _write(w, b"last words")
        os.close(w)
        fw.close(timeout=PATIENCE)
        assert out.text == expected
        out.parts.clear()


def test_without_prefix_lines_of_ranks_do_not_mix(monkeypatch):
    out = _sink(monkeypatch)
    fw = OutputForwarder()
    w0, w1 = fw.pipe(0, "stdout"), fw.pipe(1, "stdout")
    try:
        _write(w0, b"rank 0 says")
        _write(w1, b"rank 1 says hi\n")
        out.wait_for("rank 1 says hi\n")
        _write(w0, b" hello\n")
        out.wait_for("hello")
        _write(w0, b"\r 10%")  # a partial line is shown after a while, unprefixed
        out.wait_for("10%")
    finally:
        os.close(w0)
        os.close(w1)
        fw.close()
    assert "rank 0 says" + "rank 1" not in out.text
    assert "rank 1 says hi\n" in out.text
    assert out.text.endswith("\r 10%\n")


def test_a_progress_bar_is_redrawn_with_its_prefix(monkeypatch):
    out = _sink(monkeypatch)
    fw = OutputForwarder(prefix=True)
    w = fw.pipe(2, "stdout")
    _write(w, b"10%\r20%\r30%\n")
    _write(w, b"crlf\r\n")
    _write(w, b"40%\r")  # held, then shown after a while or at EOF
    os.close(w)
    fw.close(timeout=PATIENCE)
    expected = "[rank 2] 10%\r[rank 2] 20%\r[rank 2] 30%\n[rank 2] crlf\r\n[rank 2] 40%\r\n"
    assert out.text == expected


def test_utf8_split_across_reads(monkeypatch, tmp_path):
    out = _sink(monkeypatch)
    fw = OutputForwarder(log_dir=str(tmp_path))
    w = fw.pipe(0, "stdout")
    try:
        _write(w, b"caf\xc3")  # "é" is c3 a9: only its first byte
        _wait_file(tmp_path / "rank_0.log", b"caf\xc3")  # read by the forwarder
        _write(w, b"\xa9 \xe2\x82")  # the rest of "é", and half of "€"
        _wait_file(tmp_path / "rank_0.log", b"caf\xc3\xa9 \xe2\x82")
        _write(w, b"\xac\n")
    finally:
        os.close(w)
        fw.close(timeout=PATIENCE)
    assert out.text == "café €\n"


def test_invalid_utf8_is_replaced(monkeypatch):
    out = _sink(monkeypatch)
    fw = OutputForwarder(prefix=True)
    w = fw.pipe(0, "stdout")
    _write(w, b"bad \xff byte\n")
    os.close(w)
    fw.close(timeout=PATIENCE)
    assert out.text == "[rank 0] bad \ufffd byte\n"


def test_tail_keeps_the_last_lines_of_stderr(monkeypatch):
    out, err = _sink(monkeypatch), _sink(monkeypatch, "stderr")
    fw = OutputForwarder(tail_lines=5, tail_bytes=1000)
    e, o = fw.pipe(0, "stderr"), fw.pipe(0, "stdout")
    _write(o, b"stdout is not in the tail\n")
    _write(e, "".join(f"line {i} ✓\n" for i in range(30)).encode())
    os.close(e)
    os.close(o)
    assert fw.wait_eof(0, PATIENCE)
    assert fw.tail(0) == "".join(f"line {i} ✓\n" for i in range(25, 30))
    assert fw.tail(1) == ""  # a rank with nothing
    fw.close()
    assert out.text == "stdout is not in the tail\n" and err.text.startswith("line 0 ✓\n")


def test_tail_is_bounded_in_bytes(monkeypatch):
    _sink(monkeypatch, "stderr")
    fw = OutputForwarder(tail_lines=100, tail_bytes=64)
    e = fw.pipe(0, "stderr")
    _write(e, b"x" * 1000 + b"\n" + b"".join(b"%02d abcdefghij\n" % i for i in range(10)))
    os.close(e)
    fw.close(timeout=PATIENCE)
    tail = fw.tail(0)
    assert len(tail.encode()) <= 64
    assert tail.endswith("09 abcdefghij\n")
    assert re.fullmatch(r"(\d\d abcdefghij\n)+", tail)  # a cut first line is dropped


def test_show_filter_keeps_a_rank_off_the_terminal(monkeypatch, tmp_path):
    out = _sink(monkeypatch)
    err = _sink(monkeypatch, "stderr")
    fw = OutputForwarder(prefix=True, show=lambda rank: rank != 1, log_dir=str(tmp_path))
    pipes = [fw.pipe(r, s) for r in (0, 1) for s in ("stdout", "stderr")]
    for fd, data in zip(pipes, (b"o0\n", b"e0\n", b"o1\n", b"e1\n"), strict=True):
        _write(fd, data)
        os.close(fd)
    fw.close(timeout=PATIENCE)
    assert out.text == "[rank 0] o0\n" and err.text == "[rank 0] e0\n"
    assert fw.tail(1) == "e1\n"  # still kept for an error message
    assert sorted((tmp_path / "rank_1.log").read_bytes().splitlines()) == [b"e1", b"o1"]


def test_log_files_interleave_both_streams_without_prefix(monkeypatch, tmp_path):
    out, err = _sink(monkeypatch), _sink(monkeypatch, "stderr")
    log_dir = tmp_path / "logs" / "run1"  # made when needed
    fw = OutputForwarder(prefix=True, log_dir=str(log_dir))
    o0, e0, o1 = fw.pipe(0, "stdout"), fw.pipe(0, "stderr"), fw.pipe(1, "stdout")
    _write(o0, b"out 1\n")
    _wait_file(log_dir / "rank_0.log", b"out 1\n")
    _write(e0, b"err 2\n")
    _wait_file(log_dir / "rank_0.log", b"out 1\nerr 2\n")
    _write(o0, b"out 3")
    _write(o1, b"other\n")
    for fd in (o0, e0, o1):
        os.close(fd)
    fw.close(timeout=PATIENCE)
    assert (log_dir / "rank_0.log").read_bytes() == b"out 1\nerr 2\nout 3"
    assert (log_dir / "rank_1.log").read_bytes() == b"other\n"
    assert sorted(os.listdir(log_dir)) == ["rank_0.log", "rank_1.log"]
    assert err.text == "[rank 0] err 2\n"
    assert sorted(out.text.splitlines()) == ["[rank 0] out 1", "[rank 0] out 3", "[rank 1] other"]


def test_wait_eof(monkeypatch):
    out = _sink(monkeypatch)
    fw = OutputForwarder()
    w = fw.pipe(0, "stdout")
    assert fw.wait_eof(5, 0)  # a rank with no pipe has nothing to wait for
    assert not fw.wait_eof(0, 0.05)  # the write end is open: EOF cannot have come
    _write(w, b"bye\n")
    os.close(w)
    assert fw.wait_eof(0, PATIENCE)
    assert out.text == "bye\n"
    fw.close()


def test_children_are_drained_even_if_nobody_waits(monkeypatch):
    out = _sink(monkeypatch)
    # 4 MiB is far more than a pipe holds: the children finish only if their output is read
    code = "import sys\nsys.stdout.write('x' * 4096 + '\\n')\n" * 1024
    fw = OutputForwarder(show=lambda rank: False)
    procs = []
    try:
        for rank in range(2):
            w = fw.pipe(rank, "stdout")
            try:
                procs.append(subprocess.Popen([sys.executable, "-c", code], stdout=w))
            finally:
                os.close(w)
        for p in procs:
            assert p.wait(timeout=PATIENCE * 2) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        fw.close(timeout=PATIENCE)
    assert out.text == ""


def test_close_stops_when_a_grandchild_holds_the_pipe(monkeypatch):
    out = _sink(monkeypatch)
    # the child leaves a grandchild that inherited its stdout: EOF never comes
    code = (
        "import subprocess, sys\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        "print('grandchild', p.pid, flush=True)\n"
    )
    fw = OutputForwarder(prefix=True)
    w = fw.pipe(0, "stdout")
    try:
        child = subprocess.Popen([sys.executable, "-c", code], stdout=w)
    finally:
        os.close(w)
    grandchild = None
    try:
        assert child.wait(timeout=PATIENCE) == 0
        match = re.search(r"grandchild (\d+)\n", out.wait_for("\n"))
        assert match
        grandchild = int(match.group(1))
        assert not fw.wait_eof(0, 0.05)
        started = time.monotonic()
        fw.close(timeout=0.5)
        assert time.monotonic() - started < PATIENCE
        assert fw.wait_eof(0, 0)  # closed: nothing more will come, nothing to wait for
    finally:
        fw.close(timeout=0)
        if grandchild is not None:  # reparented to the test process (a subreaper)
            os.kill(grandchild, signal.SIGKILL)
            _reap(grandchild)


def _reap(pid: int) -> None:
    deadline = time.monotonic() + PATIENCE
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return
        except ChildProcessError:
            if not os.path.exists(f"/proc/{pid}"):
                return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not go")


class Broken:
    """A replaced stream that fails in any way at all."""

    def write(self, text):
        raise RuntimeError("this stream is broken")

    def flush(self):
        raise RuntimeError("this stream is broken")


def test_a_broken_stream_falls_back_to_the_descriptor(monkeypatch, capfd):
    fw = OutputForwarder(prefix=True)
    w = fw.pipe(0, "stdout")
    [thread] = [t for t in threading.enumerate() if t.name == "procspawn-output"]
    try:
        monkeypatch.setattr(sys, "stdout", Broken())
        _write(w, b"to fd 1\n")
        deadline = time.monotonic() + PATIENCE
        seen = ""
        while "to fd 1" not in seen and time.monotonic() < deadline:
            seen += capfd.readouterr().out
            time.sleep(0.01)
        assert seen == "[rank 0] to fd 1\n"
        sink = Sink()
        monkeypatch.setattr(sys, "stdout", sink)  # looked up at each write
        _write(w, b"to the sink\n")
        sink.wait_for("[rank 0] to the sink\n")
        assert thread.is_alive()
    finally:
        os.close(w)
        fw.close(timeout=PATIENCE)


def test_descriptors_above_1024(monkeypatch):
    out = _sink(monkeypatch)
    # selectors, not select.select: a process with many descriptors gets pipes >= 1024
    fillers = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    fw = OutputForwarder(prefix=True)
    try:
        w = fw.pipe(0, "stdout")
        assert w >= 1024
        _write(w, b"high\n")
        os.close(w)
        assert fw.wait_eof(0, PATIENCE)
    finally:
        for fd in fillers:
            os.close(fd)
        fw.close()
    assert out.text == "[rank 0] high\n"


def test_close_is_idempotent_and_leaves_no_descriptor(monkeypatch, tmp_path):
    _sink(monkeypatch)
    before = set(os.listdir("/proc/self/fd"))
    fw = OutputForwarder(log_dir=str(tmp_path))
    w = fw.pipe(0, "stdout")
    os.close(w)
    fw.close(timeout=PATIENCE)
    fw.close()
    assert set(os.listdir("/proc/self/fd")) == before
    assert not [t for t in threading.enumerate() if t.name == "procspawn-output"]
    with pytest.raises(RuntimeError, match="closed"):
        fw.pipe(0, "stdout")
    OutputForwarder().close()  # never used: nothing to do
    with OutputForwarder() as unused:
        assert unused.tail(0) == ""


def test_bad_stream_name():
    fw = OutputForwarder()
    with pytest.raises(ValueError, match='"stdout" or "stderr"'):
        fw.pipe(0, "stdin")
    fw.close()


# -- real ranks: prefix_output, stderr passed through --------------------------------------


@pytest.mark.timeout(90)
def test_prefix_output_and_stderr_pass_through(start_method):
    code = textwrap.dedent(
        f"""
        import sys
        import procspawn

        def talk(rank):
            print(f"out {{rank}}", flush=True)
            print(f"err {{rank}}", file=sys.stderr, flush=True)

        if __name__ == "__main__":
            procspawn.spawn(talk, nprocs=2, prefix_output=True, start_method={start_method!r})
            procspawn.spawn(talk, nprocs=1, start_method={start_method!r})
            print("parent done")
        """
    )
    result = run_script(code, timeout=80)
    assert result.returncode == 0, result.stderr
    out_lines = result.stdout.splitlines()
    err_lines = result.stderr.splitlines()
    assert "[rank 0] out 0" in out_lines and "[rank 1] out 1" in out_lines
    assert "[rank 0] err 0" in err_lines and "[rank 1] err 1" in err_lines
    # without prefix_output: stdout is the parent's own, stderr passes through unchanged
    assert "out 0" in out_lines and "err 0" in err_lines
    assert out_lines[-1] == "parent done"


def test_pipes_made_while_held_are_forwarded_from_release(monkeypatch):
    """hold(): children start without the forwarding thread; what they wrote meanwhile
    waits in their pipes and is forwarded, whole and in order, once release() starts it."""
    out = _sink(monkeypatch)
    fw = OutputForwarder(prefix=True)
    fw.hold()
    try:
        w0, w1 = fw.pipe(0, "stdout"), fw.pipe(1, "stdout")
        assert not any(t.name == "procspawn-output" and t.ident for t in threading.enumerate())
        _write(w0, b"before release\n")
        _write(w1, b"x" * 1000 + b"\n")
        time.sleep(0.05)
        assert out.text == ""  # nobody reads yet
        fw.release()
        _write(w0, b"after release\n")
        for fd in (w0, w1):
            os.close(fd)
        assert fw.wait_eof(0, PATIENCE) and fw.wait_eof(1, PATIENCE)
        assert sorted(out.text.splitlines()) == [
            "[rank 0] after release",
            "[rank 0] before release",
            "[rank 1] " + "x" * 1000,
        ]
        assert out.text.index("before release") < out.text.index("after release")
    finally:
        fw.close(timeout=PATIENCE)


def test_a_forwarder_closed_while_held_leaves_nothing_open():
    fw = OutputForwarder()
    fw.hold()
    w = fw.pipe(0, "stderr")
    os.close(w)
    fw.close(timeout=PATIENCE)
    fw.release()  # after close: starts nothing
    assert not any(t.name == "procspawn-output" for t in threading.enumerate())


def test_held_pipes_that_never_spoke_are_drained_by_close_without_a_thread(monkeypatch):
    """A held forwarder starts no thread for pipes nobody reads from: close() reads them
    to their end itself, and forwards what they held, a partial last line included."""
    out = _sink(monkeypatch)
    fw = OutputForwarder(prefix=True)
    fw.hold()
    w0, w1 = fw.pipe(0, "stdout"), fw.pipe(1, "stdout")
    _write(w1, b"late words\nno newline")
    for fd in (w0, w1):
        os.close(fd)
    fw.close(timeout=PATIENCE)
    assert not any(t.name == "procspawn-output" for t in threading.enumerate())
    assert out.text == "[rank 1] late words\n[rank 1] no newline\n"


def test_fileno_turns_readable_when_a_held_pipe_has_output():
    import select

    fw = OutputForwarder()
    fw.hold()
    try:
        w = fw.pipe(0, "stderr")
        poller = select.poll()
        poller.register(fw.fileno(), select.POLLIN)
        assert poller.poll(0) == []  # nothing written yet
        _write(w, b"x\n")
        assert poller.poll(PATIENCE * 1000)  # readable: the owner calls release() now
        os.close(w)
    finally:
        fw.close(timeout=PATIENCE)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
def test_a_pool_starts_an_output_thread_only_once_a_worker_writes(start_method):
    """Workers that print nothing cost no output thread, not even to see their pipes end
    as they exit; the first line one prints starts it, and every line arrives in the
    parent's stdout and stderr."""
    code = textwrap.dedent(
        f"""
        import sys, threading, time
        import procspawn

        def quiet(x):
            return x + 1

        def talk(x):
            print(f"out {{x}}", flush=True)
            print(f"err {{x}}", file=sys.stderr, flush=True)
            return x

        def output_threads():
            return [t for t in threading.enumerate() if t.name == "procspawn-output"]

        started = []
        real_start = threading.Thread.start

        def start(self):
            started.append(self.name)
            real_start(self)

        threading.Thread.start = start

        if __name__ == "__main__":
            with procspawn.Pool(2, context={start_method!r}) as pool:
                assert pool.map(quiet, range(20)) == list(range(1, 21))
            with procspawn.ProcessPoolExecutor(2, mp_context={start_method!r}) as ex:
                assert ex.submit(quiet, 1).result() == 2
            assert "procspawn-output" not in started, started  # not even to see them end
            with procspawn.Pool(2, context={start_method!r}) as pool:
                assert pool.map(quiet, range(20)) == list(range(1, 21))
                time.sleep(0.2)
                assert not output_threads(), "a quiet pool started an output thread"
                assert pool.map(talk, range(4), chunksize=1) == list(range(4))
                deadline = time.monotonic() + 20
                while not output_threads() and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert output_threads()
            with procspawn.ProcessPoolExecutor(2, mp_context={start_method!r}) as ex:
                assert ex.submit(talk, 9).result() == 9
            print("parent done")
        """
    )
    result = run_script(code, timeout=100)
    assert result.returncode == 0, result.stderr
    out_lines = result.stdout.splitlines()
    err_lines = result.stderr.splitlines()
    assert sorted(line for line in out_lines if line.startswith("out ")) == [
        "out 0",
        "out 1",
        "out 2",
        "out 3",
        "out 9",
    ]
    assert sorted(line for line in err_lines if line.startswith("err ")) == [
        "err 0",
        "err 1",
        "err 2",
        "err 3",
        "err 9",
    ]
    assert out_lines[-1] == "parent done"


@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_a_tasks_lines_come_before_its_result(method):
    """A task prints, then returns, and the caller prints what it got: the task's line
    comes first every time, on stdout and stderr, and is there even when the program
    then leaves with os._exit (the worker's lines, relayed by the parent, came after the
    caller's in ~1 of 10 calls, and were lost at an os._exit in 4 of 10 runs)."""
    code = textwrap.dedent(
        f"""
        import os, sys
        import procspawn

        def work(i):
            print(f"task {{i}}", flush=True)
            print(f"task {{i}} err", file=sys.stderr, flush=True)
            return i

        if __name__ == "__main__":
            with procspawn.Pool(2, context={method!r}) as pool:
                for i in range(60):
                    got = pool.apply(work, (i,)) if i % 2 else pool.apply_async(work, (i,)).get()
                    print(f"caller {{got}}", flush=True)
                    print(f"caller {{got}} err", file=sys.stderr, flush=True)
            with procspawn.ProcessPoolExecutor(1, mp_context={method!r}) as ex:
                print(f"caller {{ex.submit(work, 60).result()}}", flush=True)
                pool = procspawn.Pool(1, context={method!r})
                print(f"caller {{pool.apply(work, (61,))}}", flush=True)
                os._exit(0)
        """
    )
    result = run_script(code)
    assert result.returncode == 0, result.stderr
    out = [f"{who} {i}" for i in range(62) for who in ("task", "caller")]
    assert result.stdout.splitlines() == out
    err = [f"{who} {i} err" for i in range(60) for who in ("task", "caller")]
    assert result.stderr.splitlines()[: len(err)] == err
