"""procspawn's fork server: started once, reused, preloaded, the parent's environment."""

from __future__ import annotations

import os
import textwrap

import pytest
from _helpers import ROOT, run_file, run_script, run_stdin_script

import procspawn as mp


def _parent_pid(rank):
    return os.getppid()


def _read_env(rank, name):
    return os.environ.get(name), os.environ.get("RANK")


def test_one_server_serves_every_spawn():
    first = mp.spawn(_parent_pid, nprocs=2, start_method="forkserver")
    second = mp.spawn(_parent_pid, nprocs=2, start_method="forkserver")
    assert len(set(first + second)) == 1  # the same server forked all four
    assert first[0] != os.getpid()


def test_ranks_get_the_parent_environment_of_now(monkeypatch):
    mp.spawn(_parent_pid, nprocs=1, start_method="forkserver")  # the server runs already
    monkeypatch.setenv("PROCSPAWN_TEST_LATE_VARIABLE", "set after the server started")
    out = mp.spawn(
        _read_env, args=("PROCSPAWN_TEST_LATE_VARIABLE",), nprocs=2, start_method="forkserver"
    )
    assert out == [("set after the server started", "0"), ("set after the server started", "1")]


def test_set_forkserver_preload_checks_its_argument():
    with pytest.raises(TypeError, match="list of module names"):
        mp.set_forkserver_preload("numpy")


@pytest.mark.timeout(90)
def test_preloaded_modules_are_imported_once_in_the_server():
    code = textwrap.dedent(
        """
        import os
        import procspawn

        def where(rank):
            import _preload_marker
            return _preload_marker.IMPORTED_IN, os.getppid(), os.getpid()

        if __name__ == "__main__":
            procspawn.set_forkserver_preload(["_preload_marker"])
            for imported_in, server, me in procspawn.spawn(where, nprocs=2,
                                                            start_method="forkserver"):
                assert imported_in == server != me, (imported_in, server, me)
            print("ok")
        """
    )
    env = {"PYTHONPATH": os.path.join(ROOT, "tests") + os.pathsep + ROOT}
    result = run_script(code, timeout=80, env_extra=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


@pytest.mark.timeout(90)
def test_a_script_on_stdin_runs_under_forkserver():
    code = textwrap.dedent(
        """
        import procspawn

        def f(rank):
            return rank + 40

        if __name__ == "__main__":
            print(procspawn.spawn(f, nprocs=2, start_method="forkserver"))
        """
    )
    result = run_stdin_script(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[40, 41]"


def _sleep_long(rank):
    import time

    time.sleep(60)


def test_a_rank_that_cannot_start_stops_those_started_in_parallel(monkeypatch):
    from procspawn.context import _spawn

    real = _spawn._start_rank

    def failing(rank, *args):
        if rank == 5:
            raise OSError("cannot start rank 5 (made up by the test)")
        return real(rank, *args)

    monkeypatch.setattr(_spawn, "_start_rank", failing)
    with pytest.raises(OSError, match="cannot start rank 5"):
        mp.spawn(_sleep_long, nprocs=8, start_method="forkserver")
    # the ranks that had started were stopped and reaped: the leak check finds no child,
    # no descriptor and no segment left


def test_parallel_start_gives_results_by_rank():
    assert mp.spawn(_parent_pid, nprocs=1, start_method="forkserver")  # server warm
    out = mp.spawn(_read_env, args=("PATH",), nprocs=9, start_method="forkserver")
    assert [rank for _, rank in out] == [str(r) for r in range(9)]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("parent_uses_numpy", [False, True])
def test_the_server_imports_numpy_only_for_a_parent_that_did(parent_uses_numpy):
    """NumPy is most of a cold server's start: a program that never imported it does not
    wait for it (its ranks import it if they need it); one that did has it preloaded."""
    code = textwrap.dedent(
        f"""
        import os, sys
        import procspawn
        if {parent_uses_numpy}:
            import numpy

        def server(rank):
            return os.getppid(), "numpy" in sys.modules

        if __name__ == "__main__":
            [(pid, in_rank)] = procspawn.spawn(server, nprocs=1, start_method="forkserver")
            with open(f"/proc/{{pid}}/maps") as f:
                mapped = "_multiarray_umath" in f.read()
            print(mapped, in_rank)
        """
    )
    result = run_stdin_script(code, timeout=80)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(parent_uses_numpy)] * 2


def test_a_pool_server_forks_its_first_workers_before_it_imports_cloudpickle(tmp_path):
    """A fork server started for a pool imports cloudpickle (a third of its start) once it
    has forked the first workers and is idle: the script's functions go by name without
    it. A first worker sent a lambda imports it itself; workers forked later have it.
    (The script pauses between pools: on a 16-core machine pools came back to back faster
    than the server's idle spell, and it never imported anything.)"""
    script = tmp_path / "idle_preload.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, sys, time
            import procspawn

            def state(_):
                return os.getppid(), "cloudpickle" in sys.modules

            if __name__ == "__main__":
                with procspawn.Pool(1, context="forkserver") as pool:
                    server, first = pool.apply(state, (0,))
                    assert pool.apply(lambda x: x * 2, (21,)) == 42  # by value
                deadline = time.monotonic() + 20
                later = False
                while not later and time.monotonic() < deadline:
                    time.sleep(0.1)  # idle spells: a fast machine asks back to back
                    with procspawn.Pool(1, context="forkserver") as pool:
                        again, later = pool.apply(state, (0,))
                    assert again == server, (again, server)
                print(first, later)
            """
        )
    )
    result = run_file(script)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "True"]


def test_threads_that_spawn_at_once_get_every_ranks_result(tmp_path):
    """Every Process.start() polls all of the program's children (the stdlib's cleanup),
    so two threads read one fork-server child's exit code at once: one got it, the other
    found the pipe at its end and wrote 255 over it, and a rank that had returned was
    reported as dead (2-4 of 45 spawns of 2 ranks, 3 threads, failed so)."""
    script = tmp_path / "threads.py"
    script.write_text(
        textwrap.dedent(
            """
            import threading
            import procspawn

            def rank(r):
                return r

            def loop(errors):
                for _ in range(25):
                    try:
                        assert procspawn.spawn(rank, nprocs=2, start_method="forkserver") == [0, 1]
                    except Exception as exc:
                        errors.append(repr(exc))

            if __name__ == "__main__":
                errors = []
                threads = [threading.Thread(target=loop, args=(errors,)) for _ in range(3)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(60)
                print(len(errors), errors[:2])
            """
        )
    )
    result = run_file(script, timeout=90)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "0 []", result.stdout
