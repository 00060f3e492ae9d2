"""The parent's main module as the ranks meet it: a script without the
``if __name__ == "__main__":`` guard is explained, a script on stdin runs, and the rank
variables are set before a rank imports the main module again."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from _helpers import run_file, run_stdin_script, script_env


@pytest.mark.timeout(90)
def test_missing_main_guard_is_explained(tmp_path):
    script = tmp_path / "no_guard.py"
    script.write_text(
        "import procspawn\n\ndef f(rank):\n    return rank\n\nprint(procspawn.spawn(f, nprocs=2))\n"
    )
    result = run_file(script)
    assert result.returncode != 0
    message = result.stderr[result.stderr.rindex("procspawn.ProcessExitedException: ") :]
    # one message that leads with the fix, naming the line
    assert message.startswith(
        f"procspawn.ProcessExitedException: procspawn.spawn() is called at {script}:6 when "
        f'that file is imported: put it under `if __name__ == "__main__":` in {script}.'
    ), message
    # no traceback of the children: each said one line, the parent one error
    assert result.stderr.count("Traceback") == 1, result.stderr
    assert len(result.stderr.strip().splitlines()) <= 12, result.stderr


@pytest.mark.timeout(90)
def test_script_on_stdin_runs():
    code = textwrap.dedent(
        """
        import procspawn

        def f(rank):
            return rank * 7

        if __name__ == "__main__":
            print(procspawn.spawn(f, nprocs=2))
        """
    )
    result = run_stdin_script(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[0, 7]"


@pytest.mark.timeout(90)
def test_rank_variables_are_set_before_the_main_module_is_imported_again(tmp_path):
    script = tmp_path / "main_reads_rank.py"
    script.write_text(
        textwrap.dedent(
            """
            import os
            import sys
            import procspawn

            if __name__ == "__mp_main__":  # a rank importing the main module again
                folder = os.path.dirname(os.path.abspath(__file__))
                open(os.path.join(folder, f"imported_as_{os.environ.get('RANK')}"), "w").close()

            def f(rank):
                return rank

            if __name__ == "__main__":
                print(procspawn.spawn(f, nprocs=2, start_method="spawn"))
            """
        )
    )
    result = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=80,
        env={k: v for k, v in script_env().items() if k != "RANK"},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[0, 1]"
    assert sorted(p.name for p in tmp_path.glob("imported_as_*")) == [
        "imported_as_0",
        "imported_as_1",
    ]
