"""``procspawn run``: start N copies of a Python program on this machine, like torchrun.

::

    procspawn run -n 4 train.py --epochs 3      # python train.py --epochs 3, four times
    procspawn run -n 4 -m pkg.train --epochs 3  # python -m pkg.train --epochs 3, four times

Each rank is ``python script args...`` (or ``python -m module args...``) with torchrun's
environment: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR (127.0.0.1),
MASTER_PORT (a free port, unless MASTER_PORT is set), plus PROCSPAWN_RUN=1,
PROCSPAWN_START_METHOD with ``--start-method``, and PYTHONUNBUFFERED=1 unless it is set,
so what a rank prints shows up at once and is not lost if the rank is killed.

The launcher watches the ranks the way ``procspawn.spawn`` does: the first rank to exit
with a non-zero code or by a signal gets the others SIGTERM, then SIGKILL after the grace
period; then one line says which rank failed and how, followed by its traceback when its
stderr ended with one. SIGINT and SIGTERM sent to the launcher go on to every rank (a
terminal's Ctrl-C already reached the ranks, which share the launcher's process group, so
it is not sent twice), then SIGKILL after the grace period.

No rank outlives the launcher, on three layers:

* Every exit path of ``run()`` (an exception included) kills and reaps what still runs.
* SIGINT, SIGTERM and SIGCHLD are blocked in the launcher and taken with ``sigtimedwait``:
  they never interrupt the launcher half-way through starting or stopping a rank, and the
  signal's origin (a terminal, or kill()) is known. (This is why the launcher does not
  wait in ``context._watch.Watcher`` as ``spawn`` and the pools do: an epoll cannot say
  who sent a signal. It shares the rest: the grace period, how an exit is described,
  ``how_it_ended``, with the watched children of ``spawn`` and the pools.)
* If the launcher itself dies abruptly (SIGKILL, a crash), the kernel kills each rank:
  a rank starts as a tiny trampoline, ``python -c <set PR_SET_PDEATHSIG=SIGKILL, unblock
  signals> && exec python script args``. The parent-death signal survives ``execve``, so
  the program runs exactly as ``python script args`` (same pid, same argv) with the
  kernel's guarantee, and no ``preexec_fn`` (unsafe with threads) is needed. The
  trampoline exits at once if the launcher already died before the signal was set.
  The parent-death signal fires when the thread that started the rank ends, so ranks are
  only started from the launcher's main thread.

Limits: a SIGINT that kill() sends to the whole process group (``kill -INT -PGID``) is
not told apart from one sent to the launcher alone, so the ranks get it twice. SIGHUP is
not caught: it ends the launcher, and the parent-death signal the ranks. The ranks'
grandchildren are the ranks' business (``procspawn.spawn`` stops its own).

Environment: ``PROCSPAWN_GRACE_PERIOD`` (seconds, default 3) when ``--grace-period`` is
not given; ``MASTER_PORT`` is passed on when set.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NoReturn

from ._output import OutputForwarder
from .context._errors import signal_name
from .context._watch import default_grace_period, how_it_ended, oom_kills

__all__ = ["run"]

_SI_KERNEL = 0x80  # si_code of a signal the kernel sent to a process group (a terminal)
_POLL = 1.0  # seconds between looks at the ranks if no signal comes (a safety net only)
_OUTPUT_DRAIN = 1.0  # seconds to wait for the ranks' last output once they are gone
_TAIL_LINES = 200  # lines of a failed rank's stderr kept to find its traceback
_TAIL_BYTES = 64 * 1024

# Run as `python -I -S -c _TRAMPOLINE <launcher pid> <argv of the rank...>`.
_TRAMPOLINE = """\
import os, signal, sys
try:
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
except Exception:
    pass
if os.getppid() != int(sys.argv[1]):
    os.kill(os.getpid(), signal.SIGKILL)  # the launcher died before prctl: go with it
if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # a Ctrl-C that came while starting: die of it
signal.pthread_sigmask(signal.SIG_SETMASK, ())  # the launcher's blocked signals
os.execv(sys.argv[2], sys.argv[2:])
"""

_USAGE = (
    "procspawn run [-h] [-n N] [--start-method M] [--grace-period S] [--log-dir DIR]\n"
    "                     [--ranks R] [--no-prefix] (script.py | -m module) [args ...]"
)
_DESCRIPTION = """\
Run N copies (ranks) of a Python script, or of a module with -m, on this machine, like
torchrun. Everything after the script (or -m module) is passed to it untouched.

Each rank gets the environment variables RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR=127.0.0.1, MASTER_PORT (a free port unless MASTER_PORT is set) and
PROCSPAWN_RUN=1; PYTHONUNBUFFERED=1 unless it is set.

The first rank to fail (non-zero exit code or a signal) stops the others (SIGTERM, then
SIGKILL after the grace period), and its exit status and traceback are printed. Ctrl-C and
SIGTERM are passed on to every rank.

Exit status: 0 when every rank exited 0; else the failed rank's exit code, or 128 + the
signal number that killed it; 130 after SIGINT, 143 after SIGTERM; 2 for bad usage."""

_VALUE_OPTIONS = {
    "-n",
    "--nproc-per-node",
    "--nproc_per_node",
    "--start-method",
    "--grace-period",
    "--log-dir",
    "--ranks",
}


class UsageError(Exception):
    """Bad command line or environment: one line for the user, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


@dataclass
class _Options:
    nprocs: int
    target: str
    module: bool
    args: list[str]
    start_method: str | None
    grace_period: float
    log_dir: str | None
    shown: set[int] | None  # None: every rank
    prefix: bool


def _parser() -> _Parser:
    parser = _Parser(
        prog="procspawn run",
        usage=_USAGE,
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # "--grace 5 x.py" must not pass for --grace-period
    )
    parser.add_argument(
        "-n",
        "--nproc-per-node",
        dest="nprocs",
        metavar="N",
        type=int,
        default=1,
        help="number of ranks to start (default 1)",
    )
    parser.add_argument(  # torchrun's spelling too, without cluttering the help
        "--nproc_per_node", dest="nprocs", type=int, help=argparse.SUPPRESS
    )
    parser.add_argument(
        "--start-method",
        metavar="M",
        help="the start method procspawn.spawn uses inside the ranks "
        "(exported as PROCSPAWN_START_METHOD)",
    )
    parser.add_argument(
        "--grace-period",
        metavar="S",
        type=float,
        help="seconds between SIGTERM and SIGKILL when stopping ranks "
        "(default $PROCSPAWN_GRACE_PERIOD or 3)",
    )
    parser.add_argument(
        "--log-dir",
        metavar="DIR",
        help="also write each rank's output to DIR/rank_<r>.log",
    )
    parser.add_argument(
        "--ranks",
        metavar="R",
        default="all",
        help='ranks whose output is shown, as "0,2" or "all" (default all)',
    )
    parser.add_argument(
        "--no-prefix",
        dest="prefix",
        action="store_false",
        help='do not put "[rank r] " in front of each line',
    )
    parser.add_argument(
        "-m",
        dest="module_help",
        metavar="module",
        help="run a module as a script, as python -m does",
    )
    return parser


def _split(argv: Sequence[str]) -> tuple[list[str], tuple[str, bool] | None, list[str]]:
    """Split at the target: (launcher options, (target, is_module) or None, its args)."""
    head: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            if i + 1 < len(argv):
                return head, (argv[i + 1], False), list(argv[i + 2 :])
            return head, None, []
        if arg.startswith("-m") and not arg.startswith("--"):
            if len(arg) > 2:
                return head, (arg[2:], True), list(argv[i + 1 :])
            if i + 1 < len(argv):
                return head, (argv[i + 1], True), list(argv[i + 2 :])
            raise UsageError("-m needs a module name, as in: procspawn run -n 2 -m pkg.train")
        if not arg.startswith("-") or arg == "-":
            return head, (arg, False), list(argv[i + 1 :])
        if arg in _VALUE_OPTIONS and i + 1 < len(argv):
            head += argv[i : i + 2]
            i += 2
        else:
            head.append(arg)
            i += 1
    return head, None, []


def _grace_from_env() -> float:
    try:
        return default_grace_period()
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _shown_ranks(text: str, nprocs: int) -> set[int] | None:
    if text.strip() == "all":
        return None
    shown = set()
    for item in text.split(","):
        try:
            rank = int(item)
        except ValueError:
            raise UsageError(
                f'--ranks takes rank numbers separated by commas, or "all"; got {text!r}'
            ) from None
        if not 0 <= rank < nprocs:
            raise UsageError(f"--ranks: there is no rank {rank} among {nprocs} (0..{nprocs - 1})")
        shown.add(rank)
    return shown


def _check_target(target: str, module: bool) -> None:
    if module:
        top = target.split(".", 1)[0]
        if not top or not all(part.isidentifier() for part in target.split(".")):
            raise UsageError(f"-m {target!r} is not a module name")
        # Only the top-level package can be looked for without importing anything of it.
        sys.path.insert(0, os.getcwd())  # as `python -m` puts it
        try:
            found = importlib.util.find_spec(top) is not None
        except (ImportError, ValueError):
            found = False
        finally:
            sys.path.pop(0)
        if not found:
            raise UsageError(f"no module named {top!r} (it is what -m {target} would import)")
        return
    if not (os.path.isfile(target) or os.path.isfile(os.path.join(target, "__main__.py"))):
        raise UsageError(
            f"no such script: {target!r}; give the path of a Python file, "
            "or -m MODULE to run a module"
        )


def parse(argv: Sequence[str]) -> _Options:
    """The launcher's options from ``argv`` (what follows ``procspawn run``).

    Raises:
        UsageError: bad usage, with a one-line explanation.
        SystemExit: ``-h`` printed the help.
    """
    head, target, rest = _split(argv)
    parser = _parser()
    ns = parser.parse_args(head)
    if target is None:
        raise UsageError(
            "give the script to run (or -m MODULE), as in: procspawn run -n 4 train.py"
        )
    if ns.nprocs < 1:
        raise UsageError(f"-n must be >= 1 (the number of ranks), got {ns.nprocs}")
    if ns.start_method is not None:
        import multiprocessing

        methods = multiprocessing.get_all_start_methods()
        if ns.start_method not in methods:
            raise UsageError(
                f"--start-method {ns.start_method!r} is not a start method of this "
                f"platform; use one of: {', '.join(methods)}"
            )
    if ns.grace_period is None:
        grace = _grace_from_env()
    elif ns.grace_period < 0:
        raise UsageError(f"--grace-period must be >= 0, got {ns.grace_period:g}")
    else:
        grace = ns.grace_period
    _check_target(*target)
    if ns.log_dir is not None:
        try:
            os.makedirs(ns.log_dir, exist_ok=True)
        except OSError as exc:
            raise UsageError(
                f"--log-dir {ns.log_dir!r} is not a directory that can be made: "
                f"{exc.strerror or exc}"
            ) from None
    return _Options(
        nprocs=ns.nprocs,
        target=target[0],
        module=target[1],
        args=rest,
        start_method=ns.start_method,
        grace_period=grace,
        log_dir=ns.log_dir,
        shown=_shown_ranks(ns.ranks, ns.nprocs),
        prefix=ns.prefix,
    )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _traceback(tail: str) -> str | None:
    """The last Python traceback in ``tail``, to its end; None if there is none."""
    lines = tail.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent")]
    if not starts:
        return None
    return "\n".join(lines[starts[-1] :]).rstrip()


class _Launcher:
    """One run: start the ranks, watch them and the launcher's signals, stop, report."""

    def __init__(self, options: _Options) -> None:
        self.opts = options
        self.ranks: list[subprocess.Popen[bytes]] = []
        self._oom_kills: int | None = None  # the kernel's count as the ranks started
        self.signals = {signal.SIGTERM, signal.SIGCHLD}
        if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:  # nohup, `cmd &`
            self.signals.add(signal.SIGINT)

    def _argv(self) -> list[str]:
        o = self.opts
        program = [sys.executable, "-m", o.target] if o.module else [sys.executable, o.target]
        trampoline = [sys.executable, "-I", "-S", "-c", _TRAMPOLINE, str(os.getpid())]
        return trampoline + program + o.args

    def _env(self) -> dict[str, str]:
        o = self.opts
        env = dict(os.environ)
        env.update(
            WORLD_SIZE=str(o.nprocs),
            LOCAL_WORLD_SIZE=str(o.nprocs),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=os.environ.get("MASTER_PORT") or str(_free_port()),
            PROCSPAWN_RUN="1",
        )
        if o.start_method is not None:
            env["PROCSPAWN_START_METHOD"] = o.start_method
        env.setdefault("PYTHONUNBUFFERED", "1")
        return env

    def run(self) -> int:
        o = self.opts
        shown = o.shown
        output = OutputForwarder(
            prefix=o.prefix,
            show=None if shown is None else shown.__contains__,
            log_dir=o.log_dir,
            tail_lines=_TAIL_LINES,
            tail_bytes=_TAIL_BYTES,
        )
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, self.signals)
        try:
            try:
                self._start(output)
            except OSError as exc:
                print(
                    f"procspawn run: could not start rank {len(self.ranks)}: {exc}",
                    file=sys.stderr,
                )
                self._kill_all()
                return 1
            return self._watch(output)
        finally:
            try:
                self._kill_all()  # any way out: nothing of ours stays
                output.close(_OUTPUT_DRAIN)
            finally:
                while self.signals and signal.sigtimedwait(self.signals, 0) is not None:
                    pass  # taken care of, or too late to matter: do not let it kill us now
                signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)

    def _start(self, output: OutputForwarder) -> None:
        argv, env = self._argv(), self._env()
        self._oom_kills = oom_kills()
        for rank in range(self.opts.nprocs):
            env.update(RANK=str(rank), LOCAL_RANK=str(rank))
            out = output.pipe(rank, "stdout")
            try:
                err = output.pipe(rank, "stderr")
            except BaseException:
                os.close(out)
                raise
            try:
                self.ranks.append(subprocess.Popen(argv, env=env, stdout=out, stderr=err))
            finally:
                os.close(out)
                os.close(err)

    def _running(self) -> list[subprocess.Popen[bytes]]:
        return [p for p in self.ranks if p.returncode is None and p.poll() is None]

    def _send(self, signum: int, procs: list[subprocess.Popen[bytes]]) -> None:
        for p in procs:
            try:
                p.send_signal(signum)  # does nothing to a rank already reaped
            except (ProcessLookupError, PermissionError):
                pass

    def _kill_all(self) -> None:
        """SIGKILL every rank still running and reap them all."""
        running = self._running()
        self._send(signal.SIGKILL, running)
        for p in running:
            p.wait()

    def _watch(self, output: OutputForwarder) -> int:
        """Wait for the ranks; on the first failure or signal stop the rest; report."""
        o = self.opts
        failed: int | None = None
        received: int | None = None
        deadline: float | None = None  # SIGKILL what still runs at this time
        finished: set[int] = set()
        stop_signals = self.signals - {signal.SIGCHLD}
        while True:
            # A pending SIGINT / SIGTERM goes first: the ranks it killed have not failed.
            info = None
            if received is None and signal.sigpending() & stop_signals:
                info = signal.sigtimedwait(stop_signals, 0)
            if info is None:
                for rank, p in enumerate(self.ranks):
                    if rank not in finished and p.poll() is not None:
                        finished.add(rank)
                        if p.returncode != 0 and failed is None and received is None:
                            failed = rank
                if len(finished) == len(self.ranks):
                    break
                now = time.monotonic()
                if deadline is None and failed is not None:
                    self._send(signal.SIGTERM, self._running())
                    deadline = now + o.grace_period
                if deadline is not None and now >= deadline:
                    self._kill_all()
                    continue
                timeout = _POLL if deadline is None else min(_POLL, deadline - now)
                info = signal.sigtimedwait(self.signals, max(0.0, timeout))
            if info is None or info.si_signo == signal.SIGCHLD:
                continue
            if received is not None or failed is not None:
                deadline = time.monotonic()  # asked again while stopping: stop now
                continue
            received = info.si_signo
            running = self._running()
            if info.si_code == _SI_KERNEL:
                # A terminal sent it to the launcher's whole process group: only the
                # ranks that left that group did not get it.
                group = os.getpgrp()
                running = [p for p in running if _pgid(p.pid) not in (group, None)]
            self._send(received, running)
            deadline = time.monotonic() + o.grace_period
        if failed is not None:
            output.wait_eof(failed, _OUTPUT_DRAIN)
        output.close(_OUTPUT_DRAIN)
        if received is not None:
            name = signal_name(received)
            print(f"procspawn run: stopped every rank on {name}", file=sys.stderr)
            return 128 + received
        if failed is None:
            return 0
        return self._report(failed, output)

    def _report(self, rank: int, output: OutputForwarder) -> int:
        p = self.ranks[rank]
        code = p.returncode
        if code < 0:
            # for a SIGKILL: whether the kernel's out-of-memory killer did it
            how, _, _ = how_it_ended(code, p.pid, self._oom_kills)
            status = 128 - code
        else:
            how = f"failed: exit code {code}"
            status = code if 1 <= code <= 255 else 1
        lines = [f"procspawn run: rank {rank} (pid {p.pid}) {how}"]
        traceback = _traceback(output.tail(rank))
        if traceback is not None and (self.opts.shown is None or rank in self.opts.shown):
            # shown as it came: its last line here, not the whole of it a second time
            last = traceback.splitlines()[-1]
            lines += [f"rank {rank} raised {last} (its traceback is above, as [rank {rank}])"]
        elif traceback is not None:
            lines += [f"rank {rank} traceback:", traceback]
        sys.stderr.write("\n".join(lines) + "\n")
        sys.stderr.flush()
        return status


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def run(argv: Sequence[str] | None = None) -> int:
    """``procspawn run``: start the ranks, wait for them, return the exit status.

    Args:
        argv: the arguments after ``run`` (default ``sys.argv[2:]``).

    Returns:
        0 when every rank exited 0; the failed rank's exit code, or 128 + the number of
        the signal that killed it; 130 / 143 when the launcher got SIGINT / SIGTERM; 2 for
        bad usage.
    """
    if argv is None:
        argv = sys.argv[2:]
    try:
        options = parse(argv)
    except UsageError as exc:
        print(f"procspawn run: error: {exc} (see procspawn run --help)", file=sys.stderr)
        return 2
    except SystemExit as exc:  # -h
        return exc.code if isinstance(exc.code, int) else 0
    return _Launcher(options).run()
