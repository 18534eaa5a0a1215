"""The plugin tests: `plugins/` on sys.path. The LMCache tests skip unless LMCache is installed (scripts/test-plugins
makes a venv with it); the vLLM decision-logic tests run anywhere."""

from __future__ import annotations

import sys
from pathlib import Path

PLUGINS = Path(__file__).resolve().parents[2] / "plugins"
if str(PLUGINS) not in sys.path:
    sys.path.insert(0, str(PLUGINS))
