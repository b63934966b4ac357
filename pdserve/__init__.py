"""pdserve: prefill/decode disaggregated LLM serving; import-light (no torch), roles load lazily."""

from __future__ import annotations

__version__ = "0.1.0"
