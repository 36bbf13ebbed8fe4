"""Every writer publishes through megatron_lite/atomic.py: no other module renames files into place, writes a
'.tmp' sibling, or saves with torch.save / np.save to a final name."""
import pathlib
import re

ROOT = pathlib.Path(__file__).parents[1]
WRITES = re.compile(r"os\.replace\(|os\.rename\(|torch\.save\(|np\.save\(|\.savefig\(\w+\[|\+ \"\.tmp\"|\.tmp\{")
# The one rename outside atomic.py: a checkpoint's tag folder, written by every rank (DeepSpeed's files and
# ours) into a temporary folder that only rank 0 can publish, once every rank has finished.
# And np.save into the file object atomic_file hands out.
ALLOWED = {("megatron_lite/training/checkpointing.py", "os.rename("), ("megatron_lite/data/index_cache.py", "np.save(")}


def test_no_writer_publishes_files_around_the_atomic_writer():
    found = []
    for path in sorted(list((ROOT / "megatron_lite").rglob("*.py")) + list((ROOT / "tools").glob("*.py"))
                       + list((ROOT / "benchmarks").rglob("*.py"))):
        relative = str(path.relative_to(ROOT))
        if relative == "megatron_lite/atomic.py" or relative.startswith("benchmarks/bench_"):
            continue  # the writer itself; benchmarks write their scratch inputs in temporary folders
        for number, line in enumerate(path.read_text().splitlines(), 1):
            match = WRITES.search(line)
            if match and (relative, match.group(0)) not in ALLOWED and not line.lstrip().startswith("#"):
                found.append(f"{relative}:{number}: {line.strip()}")
    assert found == []
