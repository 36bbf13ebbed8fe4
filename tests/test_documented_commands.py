"""Every command line the README and docs/ show (`python tools/...`, `python benchmarks/...`, `pretrain_gpt.py`
under python, torchrun or deepspeed, `bash scripts/...`) names a file that exists, and every `--flag` on it is one
its parser lists in `--help` (with a subcommand: `TOOL SUBCOMMAND --help`). Nothing is run but `--help`.

A tool whose help says its other flags are pretrain_gpt.py's (estimate_memory.py, tune_parallelism.py plan)
also accepts pretrain_gpt.py's; after a bare `--` the flags are pretrain_gpt.py's (tune_parallelism.py sweep).
A script of scripts/ that execs a Python file with "$@" is checked against that file's parser."""
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

from tests.harness import REPO_ROOT

ROOT = pathlib.Path(REPO_ROOT)
PYTHONS = re.compile(r"^(\S*/)?python3?$")
LAUNCHERS = {"torchrun", "deepspeed"}
PRETRAIN = "pretrain_gpt.py"
FENCE = re.compile(r"^\s*```")
INLINE = re.compile(r"`([^`\n]+)`")


def documents():
    return [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))


def command_lines(markdown: str):
    """(line number, text) of each line of a fenced block (continuations joined) and each inline code span."""
    found, in_fence, pending, start = [], False, "", 0
    for number, line in enumerate(markdown.splitlines(), 1):
        if FENCE.match(line):
            in_fence, pending = not in_fence, ""
            continue
        if in_fence:
            if not pending:
                start = number
            stripped = line.rstrip()
            if stripped.endswith("\\"):
                pending += stripped[:-1] + " "
                continue
            found.append((start, pending + stripped))
            pending = ""
        else:
            found.extend((number, span) for span in INLINE.findall(line))
    return found


def words(text: str):
    try:
        return shlex.split(text, comments=True)
    except ValueError:  # an unbalanced quote in a placeholder: fall back to whitespace
        return text.split("#", 1)[0].split()


def parse(text: str):
    """(script, arguments) when the line runs one of ours, else None."""
    tokens = words(text)
    while tokens and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", tokens[0]):
        tokens = tokens[1:]  # OMP_NUM_THREADS=1 ...
    if not tokens:
        return None
    head = os.path.basename(tokens[0])
    if tokens[0] == "bash" and len(tokens) > 1 and tokens[1].startswith("scripts/"):
        return tokens[1], tokens[2:]
    if PYTHONS.match(tokens[0]) and len(tokens) > 1 and tokens[1] != "-m":
        script, rest = tokens[1], tokens[2:]
        if script.startswith(("tools/", "benchmarks/")) or script == PRETRAIN:
            return script, rest
        return None
    if head in LAUNCHERS or (PYTHONS.match(tokens[0]) and tokens[1:3] == ["-m", "torch.distributed.run"]):
        for i, token in enumerate(tokens):
            if token.endswith(".py") and (token == PRETRAIN or token.startswith(("tools/", "benchmarks/"))):
                return token, tokens[i + 1:]
    return None


# One interpreter prints many --help texts (torch is imported once, not once per tool): each script runs as
# __main__ with its folder first on sys.path, as `python SCRIPT SUBCOMMAND --help` would run it. The commands
# that end their process without the interpreter's finalization (megatron_lite/process_end.py) raise
# SystemExit here instead, so the next script still runs.
HELP_RUNNER = r"""
import contextlib, io, json, os, runpy, sys
import megatron_lite.process_end
megatron_lite.process_end.end_process = sys.exit
texts = {}
for script, subcommand in json.loads(sys.argv[1]):
    path, argv, out, code = list(sys.path), list(sys.argv), io.StringIO(), 1
    sys.argv = [script] + ([subcommand] if subcommand else []) + ["--help"]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code or 0
    except Exception:
        pass
    finally:
        sys.path[:], sys.argv = path, argv
    texts[script + " " + subcommand] = out.getvalue() if code == 0 else ""
print("HELP_TEXTS " + json.dumps(texts))
"""
HELP_TEXTS = {}


def fetch_help(requests) -> None:
    """Fill HELP_TEXTS for the (script, subcommand) pairs it lacks, in one process."""
    missing = sorted({r for r in requests if f"{r[0]} {r[1]}" not in HELP_TEXTS})
    if not missing:
        return
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", HELP_RUNNER, json.dumps(missing)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    line = [x for x in done.stdout.splitlines() if x.startswith("HELP_TEXTS ")]
    assert line, f"the --help runner failed: {done.stderr[-2000:]}"
    HELP_TEXTS.update(json.loads(line[-1][len("HELP_TEXTS "):]))


def help_text(script: str, subcommand: str = "") -> str:
    fetch_help([(script, subcommand)])
    return HELP_TEXTS[f"{script} {subcommand}"]


def subcommands(help_: str):
    usage = help_.split("\n\n", 1)[0]
    return {name for group in re.findall(r"\{([\w,-]+)\}", usage) for name in group.split(",")}


def accepted(flag: str, help_: str) -> bool:
    return re.search(r"(?<![\w-])" + re.escape(flag) + r"(?![\w-])", help_) is not None


def exec_target(script: str):
    """The Python file a shell script of ours hands its arguments to (`exec ... FILE.py "$@"`), if any."""
    match = re.search(r"exec\s.*?(\S+\.py)\s+\"\$@\"", (ROOT / script).read_text())
    return match.group(1) if match else None


def script_and_subcommand(script: str, arguments):
    """The Python file whose parser takes the arguments, and the subcommand among them (or "")."""
    if script.endswith(".sh"):
        script = exec_target(script)
        if script is None:
            return None, ""
    first = arguments[0] if arguments and not arguments[0].startswith("-") else ""
    return script, (first if first and first in subcommands(help_text(script)) else "")


def problems_in(markdown: str, where: str):
    commands = [(n, text, parse(text)) for n, text in command_lines(markdown)]
    commands = [(n, text, parsed) for n, text, parsed in commands if parsed is not None]
    existing = [(s, a) for _, _, (s, a) in commands if (ROOT / s).is_file()]
    fetch_help([(s, "") for s, _ in existing if s.endswith(".py")] + [(PRETRAIN, "")] +
               [(exec_target(s), "") for s, _ in existing if s.endswith(".sh") and exec_target(s)])
    fetch_help([pair for pair in (script_and_subcommand(s, a) for s, a in existing) if pair[0]])
    problems = []
    for number, text, (script, arguments) in commands:
        place = f"{where}:{number}: {text.strip()[:100]}"
        if not (ROOT / script).is_file():
            problems.append(f"{place}: {script} does not exist")
            continue
        arguments = [a.strip("[]") for a in arguments]
        script, subcommand = script_and_subcommand(script, arguments)
        if script is None:
            continue  # a shell script's own flags are not parsed here
        help_ = help_text(script, subcommand)
        if not help_:
            problems.append(f"{place}: `{script} {subcommand} --help` failed")
            continue
        passes_through = re.search(r"pretrain_gpt\.py\s+flag", help_) is not None
        after_separator = False
        for argument in arguments:
            if argument == "--":
                after_separator = True
                continue
            if not re.match(r"^--[A-Za-z]", argument):
                continue
            flag = argument.split("=", 1)[0]
            if after_separator:
                ok = accepted(flag, help_text(PRETRAIN))
            else:
                ok = accepted(flag, help_) or (passes_through and accepted(flag, help_text(PRETRAIN)))
            if not ok:
                problems.append(f"{place}: {flag} is not a flag of {script}{' ' + subcommand if subcommand else ''}")
    return problems


def test_every_documented_command_names_a_file_and_flags_its_parser_accepts():
    found, problems = 0, []
    for path in documents():
        markdown = path.read_text()
        found += sum(parse(text) is not None for _, text in command_lines(markdown))
        problems += problems_in(markdown, str(path.relative_to(ROOT)))
    assert found > 20, f"only {found} command lines found: is the scanner still reading the docs?"
    assert problems == [], "\n".join(problems)


def test_a_misspelt_flag_is_reported_in_a_block_and_inline():
    markdown = ("```bash\npython tools/preprocess_data.py --inptu x \\\n    --output-prefix y\n```\n"
                "Or inline: `OMP_NUM_THREADS=1 python3 tools/preprocess_data.py --outptu-prefix y`.\n")
    problems = problems_in(markdown, "synthetic.md")
    assert len(problems) == 2, problems
    assert "synthetic.md:2:" in problems[0] and "--inptu is not a flag of tools/preprocess_data.py" in problems[0]
    assert "synthetic.md:5:" in problems[1] and "--outptu-prefix" in problems[1]


def test_a_missing_file_and_a_wrong_subcommand_flag_are_reported():
    markdown = ("```\npython tools/no_such_tool.py --input x\n"
                "python tools/convert_checkpoint.py merge --load ckpt --save-typo out\n"
                "torchrun --nproc_per_node 2 pretrain_gpt.py --num-layerz 2\n```\n")
    problems = problems_in(markdown, "synthetic.md")
    assert [p.split(": ")[-1] for p in problems] == [
        "tools/no_such_tool.py does not exist",
        "--save-typo is not a flag of tools/convert_checkpoint.py merge",
        "--num-layerz is not a flag of pretrain_gpt.py"]


def test_flags_handed_on_to_pretrain_gpt_are_checked_against_its_parser():
    good = ("```\npython tools/tune_parallelism.py plan --nodes 1 --num-layers 2 --output p.json\n"
            "python tools/tune_parallelism.py sweep --plan p.json --results r -- --data-path d\n"
            "bash scripts/gpu_check.sh --dry-run --steps env\n```\n")
    assert problems_in(good, "good.md") == []
    bad = "```\npython tools/tune_parallelism.py sweep --plan p.json -- --data-pth d\nbash scripts/gpu_check.sh --dry-rn\n```"
    assert len(problems_in(bad, "bad.md")) == 2
