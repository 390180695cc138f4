"""flashport must coexist with torch and jax whatever the import order (the extension exports
nothing from its static archives: a GNU-unique libstdc++ symbol once crashed torch's import)."""
import subprocess
import sys

import pytest


@pytest.mark.parametrize("code", [
    "import flashport, torch; torch.ones(2) + 1",
    "import torch, flashport",
    "import flashport, jax, torch",
])
def test_import_order(code):
    for mod in ("torch", "jax"):
        if mod in code:
            pytest.importorskip(mod)
    r = subprocess.run([sys.executable, "-c", code + "; print('ok')"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), (r.returncode, r.stderr[-2000:])
