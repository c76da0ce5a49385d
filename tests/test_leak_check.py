"""The session-end leak check fails a session that leaves a process, a listening port or a temp
entry behind, names each, cleans them up, and passes a clean session (tests/leak_check.py)."""

import os
import subprocess
import sys
from pathlib import Path

import psutil

TESTS = Path(__file__).resolve().parent

INNER = '''
import socket, subprocess, sys, tempfile

def test_clean(tmp_path):
    (tmp_path / "kept-by-pytest").write_text("x")  # pytest's own tmp_path base is not a leak
    subprocess.run([sys.executable, "-c", "pass"], check=True)

def test_leaks():
    if "{leak}" == "process":
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    elif "{leak}" == "port":
        s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(); globals()["kept"] = s
    elif "{leak}" == "temp":
        tempfile.mkdtemp(prefix="left-behind-")
'''


def _inner(tmp_path: Path, leak: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_inner.py").write_text(INNER.replace("{leak}", leak))
    system_temp = tmp_path / "system-temp"  # the inner session's temp root lives inside ours
    system_temp.mkdir()
    env = {
        **os.environ, "PYTHONPATH": str(TESTS), "VERST_LEAK_CHECK": "1", "VERST_LEAK_CHECK_WAIT_S": "1",
        "TMPDIR": str(system_temp),
    }  # fmt: skip
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "leak_check", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_a_leaked_process_port_or_temp_dir_fails_the_session_and_is_cleaned_up(tmp_path):
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    for leak, named in (("process", "time.sleep(60)"), ("port", "listening port 127.0.0.1:"), ("temp", "left-behind-")):
        run_dir = tmp_path / leak
        run_dir.mkdir()
        out = _inner(run_dir, leak)
        assert out.returncode == 1, (leak, out.stdout[-2000:])
        assert "2 passed" in out.stdout and "leak check failed" in out.stdout and named in out.stdout, out.stdout
    after = {p.pid for p in psutil.Process().children(recursive=True)}
    assert after <= before  # the leaked sleeper was killed by the check


def test_a_clean_session_passes(tmp_path):
    out = _inner(tmp_path, "nothing")
    assert out.returncode == 0, out.stdout[-2000:]
    assert "leak check failed" not in out.stdout
