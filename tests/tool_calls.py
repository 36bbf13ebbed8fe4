"""A tool's main(argv) called in this process, as a user's command line would run it: its exit status and
output, the one line of a refusal, and what a folder holds before and after (a refusal writes nothing).

Tools refuse bad input before they read or write anything, so these calls cost milliseconds where a fresh
interpreter costs a second; tests/test_tool_startup.py keeps the few cases that need one (the imports).
"""
import contextlib
import io
import os


def call(main, argv):
    """(exit status, stdout, stderr) of main(argv); argparse's SystemExit is its status."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in argv])
        except SystemExit as e:
            code = e.code
    return code, out.getvalue(), err.getvalue()


def refusal(main, argv):
    """The one error line of a refusal: exit 2, exactly one 'error:' line, no traceback."""
    code, out, err = call(main, argv)
    lines = [line for line in err.splitlines() if "error:" in line]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, (code, out, err)
    return lines[0]


def snapshot(folder):
    """Every path under `folder` with its bytes (folders as None)."""
    found = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs:
            found[os.path.join(root, name)] = None
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                found[os.path.join(root, name)] = f.read()
    return found


def hidden(folder):
    """Dot-files under `folder`: temporaries or previous copies an overwrite left behind."""
    return [os.path.join(root, n) for root, dirs, files in os.walk(folder) for n in dirs + files if n.startswith(".")]
