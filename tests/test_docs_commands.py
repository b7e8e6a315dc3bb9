"""Every command shown in README.md and docs/ is a command that works (issue 18 item 6).

Commands are taken from fenced and indented code blocks and from inline `code` in the prose. Each one:

- names a file (script, config, DeepSpeed JSON) that exists;
- a training command (`launch/finetune.py` / `launch/pretrain.py` / `launch/classify.py`, under python, deepspeed,
  torchrun) goes through the entry point's own parser and the run configuration's
  validation: every option and dotted override in the docs must be accepted;
- any other Python command (launch/, benchmarks/, `python -m ...`) goes through its own
  argparse parser and stops right after parsing, before any work;
- a reproduction script in dry-run mode runs as shown.

A command with a placeholder (`...`, `DIR`, `N`, `[options]`) is checked for its files only.

The newcomer's path (issue 47 item 6): the commands of README.md and docs/guide.md run as a new
shell runs them after the README's two commands (`bash launch/quickstart.sh`, `bash launch/test.sh`,
which leave the project's `.venv`): no virtual environment active, pytest's own taken off PATH.
`python launch/*.py` and the `bash` scripts must find the environment themselves; `deepspeed`,
`torchrun` and `python -m` run as after the README's `source .venv/bin/activate`. Where the
checkout has no `.venv` (CI makes its own environment), they run in pytest's environment.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from parse_server import ParseServer  # tests/ is on sys.path (rootdir-relative, no package)

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]  # docs/studies/ too
NEWCOMER_DOCS = ("README.md", "guide.md")  # the README's quickstart, then the guide's commands
VENV = ROOT / ".venv"  # what `bash launch/quickstart.sh` makes
QUICKSTART_BASE = ["--deepspeed", "ds_configs/cpu.json", "--config", "launch/configs/quickstart.yaml"]
STARTS = ("python ", "deepspeed ", "bash ", "torchrun ")
PLACEHOLDER = re.compile(r"(\.\.\.|\[options\]|(?<![\w./-])(?:[A-Z]{1,4}|DIR|PATH|RUN|RUN_DIR)(?![\w.-]))")
LAUNCHER_FLAGS = {"--num_gpus", "--num_nodes", "--hostfile", "--master_port", "--master_addr", "--node_rank",
                  "--nproc_per_node", "--nnodes", "--include", "--exclude"}
LAUNCHER_SWITCHES = {"--no_ssh", "--standalone"}

# Parse, then stop: the script's own argparse parser checks the arguments, nothing runs after.
SHIM = """
import argparse, runpy, sys
def stop_after(parse):
    def parse_and_stop(self, *a, **k):
        parse(self, *a, **k)
        raise SystemExit(0)
    return parse_and_stop
for name in ("parse_args", "parse_intermixed_args"):
    setattr(argparse.ArgumentParser, name, stop_after(getattr(argparse.ArgumentParser, name)))
kind, target, *args = sys.argv[1:]
sys.argv = [target, *args]
if kind == "module":
    runpy.run_module(target, run_name="__main__", alter_sys=True)
else:
    sys.path.insert(0, str(__import__("pathlib").Path(target).resolve().parent))
    runpy.run_path(target, run_name="__main__")
raise SystemExit("the script did not parse its arguments with argparse")
"""


def _joined(lines: list[str]) -> list[str]:
    """Shell lines with backslash continuations joined, prompts (`$ `) removed."""
    out, cur = [], ""
    for raw in lines:
        line = raw.strip()
        line = line[2:] if line.startswith("$ ") else line
        cur = f"{cur} {line}".strip() if cur else line
        if cur.endswith("\\"):
            cur = cur[:-1].rstrip()
            continue
        out.append(cur)
        cur = ""
    return out + ([cur] if cur else [])


def documented_commands() -> list[tuple[str, str]]:
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
            lines = [line[2:] if line.startswith("+ ") else line for line in block.splitlines()]  # echoed by a script
            found += [(doc.name, c) for c in _joined(lines) if c.startswith(STARTS)]
        prose = re.sub(r"```.*?```", "", text, flags=re.S)
        for block in re.findall(r"(?:^|\n\n)((?: {4}.*(?:\n|$))+)", prose):  # indented code blocks
            found += [(doc.name, c) for c in _joined(block.splitlines()) if c.startswith(STARTS)]
        prose = re.sub(r"(?:^|\n\n)(?: {4}.*(?:\n|$))+", "\n\n", prose)
        for inline in re.findall(r"`([^`]+)`", prose):
            command = " ".join(inline.split())
            if command.startswith(STARTS):
                found.append((doc.name, command))
    return sorted(set(found))


COMMANDS = documented_commands()


def _strip_launcher(words: list[str]) -> list[str]:
    """The script and its arguments, without `deepspeed` / `torchrun` and their own options."""
    words = words[1:]
    while words and words[0].startswith("-"):
        flag = words.pop(0)
        if "=" not in flag and flag in LAUNCHER_FLAGS:
            words.pop(0)
        elif flag not in LAUNCHER_SWITCHES and "=" not in flag and flag not in LAUNCHER_FLAGS:
            raise AssertionError(f"unknown launcher option {flag}")
    return words


def _script_and_args(command: str) -> tuple[str, str, list[str]]:
    """(kind: `path` / `module` / `bash` / `other`, target, arguments)."""
    words = shlex.split(command.split(" #")[0].split(" | ")[0].split(" > ")[0])
    if words[0] in ("deepspeed", "torchrun"):
        words = ["python", *_strip_launcher(words)]
        if len(words) < 2 or words[1] == "...":  # a launcher's option named in the prose, no script
            return "other", "", []
    if words[0] == "bash":
        return "bash", words[1], words[2:]
    if words[1] == "-m":
        return ("module", words[2], words[3:]) if len(words) > 2 else ("other", "", [])  # `python -m` in prose
    return "path", words[1], words[2:]


def test_the_docs_show_commands():
    assert len(COMMANDS) > 30, "the extraction found too few commands"
    assert any("launch/finetune.py" in c for _, c in COMMANDS)


def test_the_parse_shim_refuses_a_bad_option(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("import argparse\np = argparse.ArgumentParser()\np.add_argument('--steps', type=int)\n"
                      "p.parse_args()\nraise SystemExit('ran past the parser')\n")
    good = subprocess.run([sys.executable, "-c", SHIM, "path", str(script), "--steps", "3"], capture_output=True)
    bad = subprocess.run([sys.executable, "-c", SHIM, "path", str(script), "--stepz", "3"], capture_output=True)
    assert good.returncode == 0 and bad.returncode == 2


@pytest.mark.parametrize("command", [
    "python launch/finetune.py optim.lrr=3e-5",                 # an unknown override
    "deepspeed --num_gpus 1 launch/pretrain.py model.preset=memorio",  # an unknown preset
    "python benchmarks/model_step.py --shapes gpt2",            # an unknown option
    "python launch/missing.py --x 1",                            # no such script
    "python launch/finetune.py --deepspeed ds_configs/zero9.json",  # no such file
])
def test_a_stale_command_fails_the_check(command, tmp_path):
    with pytest.raises((AssertionError, ValueError)):
        test_documented_command_works("doc.md", command, tmp_path)


def fresh_shell(activated: bool = False) -> dict[str, str]:
    """The environment of a new terminal after the README's two commands: no virtual environment
    active (pytest's own, and any other, taken off PATH); `activated`: after `source .venv/bin/activate`."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    path = [p for p in env.get("PATH", "").split(os.pathsep)
            if p and not (Path(p).parent / "pyvenv.cfg").is_file() and Path(p) != VENV / "bin"]
    if activated:
        path.insert(0, str(VENV / "bin"))
        env["VIRTUAL_ENV"] = str(VENV)
    env["PATH"] = os.pathsep.join(path)
    return env


def _shell(doc: str, command: str, kind: str, target: str) -> tuple[str, dict[str, str]]:
    """(the `python` a reader's shell starts, its environment) for a command of `doc`."""
    if doc not in NEWCOMER_DOCS or not (VENV / "bin" / "python").is_file():
        return sys.executable, dict(os.environ, PYTHONPATH=str(ROOT))
    # the launch/ scripts find .venv themselves; the rest runs as the README says, activated
    finds_it = kind == "bash" or (command.startswith("python ") and target.startswith("launch/"))
    env = fresh_shell(activated=not finds_it)
    python = shutil.which("python", path=env["PATH"])
    if python is None:
        pytest.skip("no `python` on PATH outside a virtual environment: a reader's shell has one")
    return python, env


def test_a_fresh_shell_has_no_virtual_environment():
    env = fresh_shell()
    assert "VIRTUAL_ENV" not in env and str(Path(sys.executable).parent) not in env["PATH"].split(os.pathsep)
    assert fresh_shell(activated=True)["PATH"].split(os.pathsep)[0] == str(VENV / "bin")


@pytest.mark.parametrize("doc,command", COMMANDS, ids=[f"{d}:{c[:60]}" for d, c in COMMANDS])
def test_documented_command_works(doc, command, tmp_path):
    kind, target, args = _script_and_args(command)
    if kind == "other":
        return
    python, env = _shell(doc, command, kind, target)
    if command.startswith(("deepspeed ", "torchrun ")) and env.get("PATH") != os.environ.get("PATH"):
        launcher = command.split()[0]
        assert shutil.which(launcher, path=env["PATH"]), f"{doc}: `{command}`: no {launcher} on the reader's PATH"
    if kind == "module":
        import importlib.util

        assert importlib.util.find_spec(target) is not None, f"{doc}: `{command}`: no module {target}"
    else:
        assert (ROOT / target).is_file(), f"{doc}: `{command}` names {target}, which does not exist"
    for word in args:  # files the command names (configs, DeepSpeed JSON)
        value = word.split("=", 1)[-1]
        if value.startswith(("ds_configs/", "launch/")) and not PLACEHOLDER.search(value):
            assert (ROOT / value).exists(), f"{doc}: `{command}` names {value}, which does not exist"
    if PLACEHOLDER.search(" ".join(args)) or not args:  # a placeholder, or a script named in the prose
        return
    if kind == "bash":
        if target.startswith("launch/repro/") and ("--mode dry-run" in command or "--help" in args):
            proc = subprocess.run(["bash", target, *args], cwd=ROOT, capture_output=True, text=True, timeout=600,
                                  env=dict(env, RUN_ROOT=str(tmp_path)))
            assert proc.returncode == 0, f"{doc}: `{command}` failed:\n{proc.stderr[-2000:]}"
        if target == "launch/quickstart.sh":  # its arguments go to launch/finetune.py after the quickstart's
            from memoria_ds.train.cli import parse

            parse([*QUICKSTART_BASE, *args], "docs", [])
        return
    if target in ("launch/finetune.py", "launch/pretrain.py", "launch/classify.py"):
        from memoria_ds.train.cli import parse

        defaults = [] if target.endswith("finetune.py") else _entry_defaults(target)
        parse(args, "docs", defaults)  # every option and dotted override is accepted and valid
        return
    code, stderr = _parse_server(python, env).run(kind, target, args)
    assert code == 0, f"{doc}: `{command}` is refused by its parser:\n{stderr[-2000:]}"


_SERVERS: dict[tuple, ParseServer] = {}


def _parse_server(python: str, env: dict[str, str]) -> ParseServer:
    """The parse server of a reader's interpreter and environment, started on first use."""
    env = {k: v for k, v in env.items() if k != "PYTEST_CURRENT_TEST"}  # pytest's, changes with every test
    key = (python, tuple(sorted(env.items())))
    if key not in _SERVERS:
        _SERVERS[key] = ParseServer(python, env, ROOT, SHIM)
    return _SERVERS[key]


@pytest.fixture(scope="module", autouse=True)
def _close_parse_servers():
    yield
    while _SERVERS:
        _SERVERS.popitem()[1].close()


def _entry_defaults(target: str) -> list[str]:
    """The `base_overrides` an entry point (launch/pretrain.py, launch/classify.py) passes to the CLI."""
    source = (ROOT / target).read_text()
    if "base_overrides=CLASSIFY_OVERRIDES" in source:  # launch/classify.py: the list lives in the CLI module
        from memoria_ds.train.cli import CLASSIFY_OVERRIDES

        return list(CLASSIFY_OVERRIDES)
    match = re.search(r"base_overrides=\[(.*?)\]", source, re.S)
    return re.findall(r'"([^"]+)"', match.group(1)) if match else []
