"""Hostile programs in the sandbox (issue 40): each ends with a non-ok status (or is contained),
a benign neighbour running at the same time still passes, and the pool fixture checks that no
process and no input folder is left behind. Host files the program attacks are checked unchanged.

Each test names the protection it proves; docs/code.md lists them. Small limits (1 CPU second,
256 MB, 32 processes, 16 MB files, 3 s wall) keep the module at a few seconds.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from verst.rollout.sandbox import ExecResult, ExecStatus, SandboxPool

BAD = {ExecStatus.ERROR, ExecStatus.TIMEOUT, ExecStatus.KILLED, ExecStatus.OUTPUT_LIMIT}


async def run_beside_benign(pool: SandboxPool, code: str, **kw) -> ExecResult:
    """Run `code` while a benign program runs beside it; the benign one must pass."""
    hostile, benign = await asyncio.gather(pool.run(code, **kw), pool.run("print(sum(range(10)))"))
    assert benign.status is ExecStatus.OK and benign.stdout == "45\n", benign
    return hostile


def _digest(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


async def test_fork_bomb_hits_the_process_limit(pool):
    """RLIMIT_NPROC (per-sandbox uid): a fork bomb cannot exhaust the host's processes."""
    code = "import os\nwhile True:\n    os.fork()\n"
    res = await run_beside_benign(pool, code)
    assert res.status in BAD
    assert res.wall_s < 6


async def test_infinite_loop_hits_the_cpu_limit(pool):
    """RLIMIT_CPU: a busy loop is killed after its CPU seconds (SIGXCPU), before the wall clock."""
    pool.cfg.limits.wall_s = 20.0  # a loaded box may give 1 CPU second slowly; the CPU limit must end it
    res = await run_beside_benign(pool, "while True:\n    pass\n")
    assert res.status is ExecStatus.KILLED, res


async def test_sleeping_forever_hits_the_wall_clock(pool):
    """The wall-clock timeout: a program that uses no CPU is killed at wall_s."""
    res = await run_beside_benign(pool, "import time\ntime.sleep(60)\n")
    assert res.status is ExecStatus.TIMEOUT and res.exit_code is None
    assert 2.9 < res.wall_s < 5


async def test_memory_bomb_hits_the_address_space_limit(pool):
    """RLIMIT_AS: allocating 8 GB fails inside the sandbox (MemoryError), the host is untouched."""
    code = "x = []\nwhile True:\n    x.append(bytearray(64 << 20))\n"
    res = await run_beside_benign(pool, code)
    assert res.status in BAD and "MemoryError" in res.stderr, res


async def test_one_gigabyte_write_hits_the_file_size_limit(pool):
    """RLIMIT_FSIZE and the size-capped tmpfs: a 1 GB file (or many files) cannot fill a disk."""
    code = (
        "chunk = b'x' * (1 << 20)\n"
        "with open('big', 'wb') as f:\n"
        "    for _ in range(1024):\n"
        "        f.write(chunk)\n"
    )
    res = await run_beside_benign(pool, code)
    assert res.status in BAD and "File too large" in res.stderr, res
    many = "chunk = b'x' * (8 << 20)\nfor i in range(128):\n    open(f'f{i}', 'wb').write(chunk)\n"
    res = await run_beside_benign(pool, many)
    assert res.status in BAD and "No space left" in res.stderr, res


async def test_files_outside_the_working_directory_are_out_of_reach(pool, tmp_path):
    """The narrow read-only binds: the run directory, home, /etc/passwd and ssh keys are not
    visible or not writable, and stay unchanged on the host."""
    canary = tmp_path / "run_dir_canary.txt"
    canary.write_text("host")
    home = os.path.expanduser("~")
    passwd = _digest("/etc/passwd")
    code = f"""
import os
hits = []
for path in [{str(canary)!r}, {home!r} + '/.ssh/id_rsa', {home!r} + '/.bashrc', '/etc/passwd',
             '/etc/shadow', {os.getcwd()!r} + '/pyproject.toml']:
    try:
        open(path).read(); hits.append('read ' + path)
    except OSError:
        pass
for path in [{str(canary)!r}, '/etc/passwd', {home!r} + '/.ssh/authorized_keys', '/usr/evil', '/evil']:
    try:
        open(path, 'a').write('pwned'); hits.append('wrote ' + path)
    except OSError:
        pass
print(hits)
"""
    res = await run_beside_benign(pool, code)
    assert res.status is ExecStatus.OK and res.stdout == "[]\n", res
    assert canary.read_text() == "host" and _digest("/etc/passwd") == passwd
    assert (
        not os.path.exists(os.path.join(home, ".ssh", "authorized_keys"))
        or "pwned" not in Path(home, ".ssh", "authorized_keys").read_text()
    )


async def test_connecting_to_a_host_server_on_loopback_fails(pool):
    """The network namespace: a server listening on the host's 127.0.0.1 is unreachable."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.setblocking(False)
    port = server.getsockname()[1]
    code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\nprint('connected')\n"
    try:
        res = await run_beside_benign(pool, code)
        assert res.status is ExecStatus.ERROR and "connected" not in res.stdout, res
        assert "ConnectionRefusedError" in res.stderr or "unreachable" in res.stderr, res.stderr
        try:
            server.accept()
            raise AssertionError("the sandbox reached the host's server")
        except BlockingIOError:
            pass
    finally:
        server.close()


async def test_signalling_the_parent_and_the_host_fails(pool):
    """The pid namespace: the trainer and other host processes cannot be signalled."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        code = f"""
import os, signal
for pid in [{os.getpid()}, {sleeper.pid}, os.getppid()]:
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError as exc:
        print(type(exc).__name__)
os.kill(-1, signal.SIGKILL)
"""
        res = await run_beside_benign(pool, code)
        assert res.status in BAD | {ExecStatus.OK}
        time.sleep(0.1)
        assert sleeper.poll() is None, "the sandbox killed a host process"
    finally:
        sleeper.kill()
        sleeper.wait()


async def test_another_samples_files_are_invisible(pool):
    """A fresh tmpfs per execution and the pid namespace: a sample cannot read a neighbour's files."""
    writer = "import time\nopen('secret.txt', 'w').write('s3cret')\ntime.sleep(1.0)\n"
    reader = """
import glob, time
time.sleep(0.3)
found = glob.glob('/work/secret.txt') + glob.glob('/proc/*/root/work/secret.txt')
found += glob.glob('/tmp/verst-sandbox-*') + glob.glob('/in/files/secret.txt')
print(found)
"""
    w, r = await asyncio.gather(pool.run(writer), pool.run(reader))
    assert w.status is ExecStatus.OK and r.status is ExecStatus.OK, (w, r)
    assert r.stdout == "[]\n"


async def test_a_process_that_outlives_the_timeout_is_killed(pool):
    """Killing the process group and the pid namespace: a daemon started inside dies with the run
    (both when the program times out and when it exits first); the fixture checks none is left."""
    daemon = (
        "import os, subprocess, time\n"
        "subprocess.Popen(['sleep', '60'], start_new_session=True)\n"
        "if os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\n"
    )
    res = await run_beside_benign(pool, daemon + "time.sleep(60)\n")
    assert res.status is ExecStatus.TIMEOUT
    res = await run_beside_benign(pool, daemon + "print('bye')\n")
    assert res.status is ExecStatus.OK


async def test_printing_100_megabytes_hits_the_output_cap(pool):
    """The output cap: 100 MB on stdout is cut at max_output_bytes and the run is killed."""
    code = "import sys\nfor _ in range(100):\n    sys.stdout.write('x' * (1 << 20))\n"
    res = await run_beside_benign(pool, code)
    assert res.status is ExecStatus.OUTPUT_LIMIT and res.stdout_truncated
    assert len(res.stdout) == pool.cfg.limits.max_output_bytes


async def test_closing_stdout_does_not_escape_the_timeout(pool):
    """Closing both streams ends the reads, not the wall clock: the program is still timed out."""
    code = "import os, time\nos.close(1)\nos.close(2)\ntime.sleep(60)\n"
    res = await run_beside_benign(pool, code)
    assert res.status is ExecStatus.TIMEOUT


async def test_binary_garbage_on_stdout_is_decoded_with_replacement(pool):
    """Output is bytes decoded with errors='replace': garbage never raises in the trainer."""
    code = "import os, sys\nsys.stdout.buffer.write(os.urandom(4096) + b'\\xff\\xfe\\x00end')\n"
    res = await run_beside_benign(pool, code)
    assert res.status is ExecStatus.OK and res.stdout.endswith("\x00end") and "\ufffd" in res.stdout


async def test_os_system_and_subprocess_run_inside_and_stay_contained(pool, tmp_path):
    """Shell commands are allowed and run inside the same sandbox (same binds, limits, network)."""
    code = f"""
import os, subprocess
os.system('echo from-shell; touch {tmp_path}/shell_was_here 2>/dev/null; cat /etc/passwd 2>/dev/null')
print(subprocess.run(['ls', '/'], capture_output=True, text=True).stdout.split())
"""
    res = await run_beside_benign(pool, code)
    assert res.status is ExecStatus.OK and res.stdout.startswith("from-shell\n"), res
    assert "root:" not in res.stdout and not (tmp_path / "shell_was_here").exists()


async def test_importing_a_missing_module_is_an_error(pool):
    """A missing module is an ordinary error with its traceback, not a sandbox failure."""
    res = await run_beside_benign(pool, "import no_such_module_verst\n")
    assert res.status is ExecStatus.ERROR and "ModuleNotFoundError" in res.stderr


async def test_syntax_errors_are_told_apart(pool):
    """Code that does not compile is `syntax_error` (nothing ran), with Python's message."""
    res = await run_beside_benign(pool, "def f(:\n    pass\n")
    assert res.status is ExecStatus.SYNTAX_ERROR and "SyntaxError" in res.stderr


async def test_code_runs_unprivileged_with_stdin_and_files(pool):
    """The normal path: files and stdin arrive, the code is not root on the host, writes stay inside."""
    code = "import os\nprint(input(), open('data/x.txt').read(), os.getuid() != 0)\nopen('out', 'w').write('y')\n"
    res = await pool.run(code, stdin="hello\n", files={"data/x.txt": "file"})
    assert res.status is ExecStatus.OK and res.stdout == "hello file True\n", res
