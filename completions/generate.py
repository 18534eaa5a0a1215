#!/usr/bin/env python3
"""Regenerate the shell completions in this folder from the installed `bsr` app.

python completions/generate.py          # write bsr.bash, _bsr (zsh), bsr.fish
python completions/generate.py --check  # exit 1 and name the stale files when they drift
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
FILES = {"bash": "bsr.bash", "zsh": "_bsr", "fish": "bsr.fish"}


def script_for(shell: str) -> str:
    env = dict(os.environ, _BSR_COMPLETE=f"source_{shell}")
    cmd = [sys.executable, "-c", "import sys; sys.argv[0] = 'bsr'; from bsr_cli.cli.main import main; main()"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60, check=True).stdout
    return out.strip() + "\n"


def main() -> int:
    check = "--check" in sys.argv
    stale = []
    for shell, name in FILES.items():
        text, path = script_for(shell), HERE / name
        if check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
    if stale:
        print(f"stale completions: {', '.join(stale)}; run: python completions/generate.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
