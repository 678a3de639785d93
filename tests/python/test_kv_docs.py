"""test_kv_docs.py: every ```python block of docs/kv_cache.md runs as written,
each in a fresh process on tidalloc's host backend (CPU tensors), and what
it prints matches the comments it gives (`print(x)  # expected`). Skipped
without torch and transformers."""
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("torch", reason="docs/kv_cache.md's code needs torch (not installed here; "
                    "scripts/torch_venv.sh)")
pytest.importorskip("transformers", reason="docs/kv_cache.md's code needs transformers "
                    "(not installed here; scripts/torch_venv.sh)")

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
DOC = os.path.join(ROOT, "docs", "kv_cache.md")


def blocks():
    with open(DOC) as f:
        text = f.read()
    return re.findall(r"```python\n(.*?)```", text, re.S)


def expected_prints(code):
    """The `# expected` comments of print lines, in order."""
    return [m.group(1).strip() for m in re.finditer(r"^print\(.*\)\s+#\s*(.+)$", code, re.M)]


def test_the_page_has_code():
    assert len(blocks()) >= 6


@pytest.mark.parametrize("index", range(len(blocks())))
def test_block_runs_as_written(index):
    code = blocks()[index]
    env = dict(os.environ, TIDALLOC_CONF="backend:host", OMP_NUM_THREADS="1",
               PYTHONPATH=os.path.join(ROOT, "python") + os.pathsep +
               os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, "block %d failed:\n%s\n%s" % (index, code, r.stderr)
    printed = [line.strip() for line in r.stdout.splitlines() if line.strip()]
    for want in expected_prints(code):
        # The comment's first words are what is printed; the rest explains.
        head = want.split(":")[0].strip() if ":" in want and not want.startswith("torch") \
            else want
        assert any(line.startswith(head) for line in printed), (want, printed)
