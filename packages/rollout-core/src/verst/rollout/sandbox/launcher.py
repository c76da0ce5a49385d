"""The launcher that runs first inside the sandbox: drop to the worker's uid, set the rlimits,
copy the input files into the working tmpfs, check the syntax, then exec the interpreter.

Its source is handed to `python -I -S -c`; it imports nothing from verst. Arguments (JSON in
argv[1]): uid (or null), limits (name -> value), python, stdin (bool), secret_fd (or null: the
read end of a pipe holding the caller's secret, moved to fd 3 = `SECRET_FD` for the program).
"""

from __future__ import annotations

LAUNCHER_SOURCE = r"""
import json, os, resource, shutil, sys
a = json.loads(sys.argv[1])
if a.get("secret_fd") is not None and a["secret_fd"] != 3:
    os.dup2(a["secret_fd"], 3)
    os.close(a["secret_fd"])
if a["uid"] is not None and os.getuid() == 0:
    os.setgroups([])
    os.setresgid(a["uid"], a["uid"], a["uid"])
    os.setresuid(a["uid"], a["uid"], a["uid"])
for name, value in a["limits"].items():
    resource.setrlimit(getattr(resource, name), (value[0], value[1]))
src = a["indir"] + "/files"
for root, dirs, files in os.walk(src):
    rel = os.path.relpath(root, src)
    dst = os.path.normpath(os.path.join(a["workdir"], rel))
    os.makedirs(dst, exist_ok=True)
    for f in files:
        shutil.copyfile(os.path.join(root, f), os.path.join(dst, f))
os.chdir(a["workdir"])
fd = os.open(a["indir"] + "/stdin", os.O_RDONLY)
os.dup2(fd, 0)
os.close(fd)
with open(a["main"], "rb") as f:
    code = f.read()
try:
    compile(code, a["main"], "exec")
except (SyntaxError, ValueError) as exc:
    import traceback
    sys.stderr.write("".join(traceback.format_exception_only(type(exc), exc)))
    sys.stderr.flush()
    os._exit(a["syntax_exit"])
os.execv(a["python"], [a["python"], "-E", "-s", a["main"]])
"""
"""Runs inside the sandbox as `python -I -S -c LAUNCHER_SOURCE ARGS_JSON`."""

SYNTAX_EXIT = 86
"""Exit code the launcher uses for code that does not compile."""

SECRET_FD = 3
"""The fd a program reads its secret from (`SandboxPool.run(..., secret=...)`): a pipe, so once
read nothing in the sandbox can read it again (unlike /in's files, which stay readable)."""
