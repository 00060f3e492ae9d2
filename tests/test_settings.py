"""One settings module: every PROCSPAWN_* variable read once, lazily, checked, documented."""

from __future__ import annotations

import importlib
import os
import re
import textwrap

import pytest
from _helpers import ROOT, run_script

from procspawn import _settings
from procspawn._settings import SETTINGS, SettingError

_SET_NOT_READ = {"PROCSPAWN_RUN"}  # procspawn run sets it for the ranks; nothing reads it


def _sources() -> dict[str, str]:
    found = {}
    for folder, _, files in os.walk(os.path.join(ROOT, "procspawn")):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path) as f:
                    found[os.path.relpath(path, ROOT)] = f.read()
    return found


def test_the_settings_page_shows_the_settings_table(tmp_path, monkeypatch):
    """docs/settings.md includes the table the documentation build writes from
    ``_settings.markdown_table()``, exactly: the documented table is the module's."""
    with open(os.path.join(ROOT, "docs", "settings.md")) as f:
        assert "```{include} _generated/settings_table.md\n```" in f.read()
    monkeypatch.syspath_prepend(os.path.join(ROOT, "docs", "_scripts"))
    docgen = importlib.import_module("docgen")
    with open(docgen.write_settings_table(str(tmp_path))) as f:
        assert f.read() == _settings.markdown_table() + "\n"


def test_every_variable_the_package_names_is_in_the_table_and_read_only_there():
    named = set()
    for path, text in _sources().items():
        named |= set(re.findall(r"PROCSPAWN_[A-Z_]+[A-Z]", text))
        if path != os.path.join("procspawn", "_settings.py"):
            reads = re.findall(r"environ(?:\.get)?[\[(]\s*[\"']PROCSPAWN_", text)
            assert not reads, f"{path} reads a PROCSPAWN_ variable itself"
    old_names = {old for s in SETTINGS.values() for old in s.old_names}
    assert named - _SET_NOT_READ - old_names == set(SETTINGS)


def test_the_daemons_old_setting_name_still_works_with_a_warning(monkeypatch):
    monkeypatch.delenv("PROCSPAWN_DAEMON_GRACE", raising=False)
    monkeypatch.setenv("PROCSPAWN_MANAGER_GRACE", "7.5")
    _settings.reload("PROCSPAWN_DAEMON_GRACE")
    try:
        with pytest.warns(FutureWarning, match="set PROCSPAWN_DAEMON_GRACE instead"):
            assert _settings.get("PROCSPAWN_DAEMON_GRACE") == 7.5
        monkeypatch.setenv("PROCSPAWN_MANAGER_GRACE", "soon")
        _settings.reload("PROCSPAWN_DAEMON_GRACE")
        with pytest.warns(FutureWarning), pytest.raises(SettingError) as info:
            _settings.get("PROCSPAWN_DAEMON_GRACE")
        assert "PROCSPAWN_MANAGER_GRACE='soon'" in str(info.value)  # the one the user set
        monkeypatch.setenv("PROCSPAWN_DAEMON_GRACE", "1.5")  # the new name wins, silently
        _settings.reload("PROCSPAWN_DAEMON_GRACE")
        assert _settings.get("PROCSPAWN_DAEMON_GRACE") == 1.5
    finally:
        monkeypatch.undo()
        _settings.reload("PROCSPAWN_DAEMON_GRACE")


@pytest.mark.parametrize(
    ("text", "value"),
    [("65536", 65536), ("64k", 65536), ("64K", 65536), ("64KiB", 65536), ("4M", 4 << 20)],
)
def test_sizes_take_binary_units(text, value):
    assert SETTINGS["PROCSPAWN_INLINE_BYTES"].parse(text) == value
    assert SETTINGS["PROCSPAWN_POOL_BYTES"].parse("1G") == 1 << 30


@pytest.mark.parametrize(
    ("name", "text", "hint"),
    [
        ("PROCSPAWN_INLINE_BYTES", "lots", "a number of bytes, as in 65536, 64k, 4M or 1G"),
        ("PROCSPAWN_POOL_BYTES", "-1", "a number of bytes"),
        ("PROCSPAWN_GRACE_PERIOD", "-1", "a number of seconds, 0 or more"),
        ("PROCSPAWN_SLAB_LINGER", "nan", "a number of seconds"),
        ("PROCSPAWN_DEBUG", "maybe", "1 or 0"),
    ],
)
def test_a_bad_value_is_an_error_naming_the_variable_and_a_good_value(name, text, hint):
    with pytest.raises(SettingError) as caught:
        SETTINGS[name].parse(text)
    assert str(caught.value).startswith(f"{name}={text!r} is not valid: use ")
    assert hint in str(caught.value)
    assert isinstance(caught.value, ValueError)


def test_read_once_at_first_use_then_kept(monkeypatch):
    monkeypatch.setenv("PROCSPAWN_SLAB_LINGER", "7")
    _settings.reload("PROCSPAWN_SLAB_LINGER")
    assert _settings.get("PROCSPAWN_SLAB_LINGER") == 7.0
    monkeypatch.setenv("PROCSPAWN_SLAB_LINGER", "8")
    assert _settings.get("PROCSPAWN_SLAB_LINGER") == 7.0  # kept
    monkeypatch.setenv("PROCSPAWN_SLAB_LINGER", "")
    _settings.reload("PROCSPAWN_SLAB_LINGER")
    assert _settings.get("PROCSPAWN_SLAB_LINGER") == 1.0  # empty is unset


def test_a_bad_value_fails_the_call_that_needs_it_not_the_import():
    code = textwrap.dedent(
        """
        import numpy as np
        import procspawn as mp

        q = mp.SimpleQueue()       # import and a channel: nothing read the variable yet
        try:
            q.put(np.zeros(100))   # the first array asks whether to pickle it inline
        except mp.SettingError as exc:
            print(type(exc).__name__, exc)
        """
    )
    result = run_script(code, env_extra={"PROCSPAWN_INLINE_BYTES": "lots"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(
        "SettingError PROCSPAWN_INLINE_BYTES='lots' is not valid: use a number of bytes"
    )


def test_a_size_with_a_unit_works_end_to_end():
    code = textwrap.dedent(
        """
        import numpy as np
        import procspawn as mp
        from procspawn import sharing

        def fn(rank, small, large):
            return sharing.is_shared(small), sharing.is_shared(large)

        if __name__ == "__main__":
            print(mp.spawn(fn, args=(np.zeros(1000), np.zeros(2000)), nprocs=1))
        """
    )
    # 8,000 bytes are under 1k * 10 = 10,240: inline; 16,000 are over: shared
    result = run_script(code, env_extra={"PROCSPAWN_INLINE_BYTES": "10k"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[(False, True)]"


def test_a_bad_value_is_its_own_error_from_every_call_that_starts_or_sends():
    code = textwrap.dedent(
        """
        import numpy as np
        import procspawn as mp
        from procspawn import sharing

        def rank(rank, *args):
            return rank

        calls = {
            "spawn(array)": lambda: mp.spawn(rank, args=(np.ones(100_000),), timeout=30),
            "spawn(shared)": lambda: mp.spawn(rank, args=(np.zeros(3),), timeout=30),
            "spawn()": lambda: mp.spawn(rank, timeout=30),
            "Pool": lambda: mp.Pool(2),
            "ProcessPoolExecutor": lambda: mp.ProcessPoolExecutor(2),
            "Process.start": lambda: mp.Process(target=print).start(),
            "Queue.put": lambda: mp.SimpleQueue().put({"plain": 1}),
            "Pipe.send": lambda: mp.Pipe()[0].send("plain"),
        }
        if __name__ == "__main__":
            for name, call in calls.items():
                try:
                    call()
                    print(name, "no error")
                except mp.SettingError as exc:
                    print(name, "SettingError", str(exc).split(" is ")[0])
                except Exception as exc:
                    print(name, type(exc).__name__, exc)
        """
    )
    result = run_script(code, env_extra={"PROCSPAWN_GRACE_PERIOD": "soon"})
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 8, result.stdout
    for line in lines:
        assert line.endswith("SettingError PROCSPAWN_GRACE_PERIOD='soon'"), line


def test_info_shows_every_setting_in_effect_and_flags_a_bad_one():
    import subprocess
    import sys

    from _helpers import script_env

    env = {**script_env(), "PROCSPAWN_INLINE_BYTES": "lots", "PROCSPAWN_START_METHOD": "spawn"}
    result = subprocess.run(
        [sys.executable, "-m", "procspawn", "info"],
        capture_output=True,
        text=True,
        timeout=50,
        env=env,
    )
    assert result.returncode == 1, result.stderr  # something to fix
    text = result.stdout
    assert "start method: spawn" in text
    assert "sharing strategy: file_descriptor" in text
    for name in SETTINGS:
        assert f"  {name}: " in text
    bad = [line for line in text.splitlines() if "<- BAD" in line]
    assert len(bad) == 1 and bad[0].startswith("  PROCSPAWN_INLINE_BYTES: 'lots'"), bad
    assert "  PROCSPAWN_START_METHOD: 'spawn' = spawn\n" in text
