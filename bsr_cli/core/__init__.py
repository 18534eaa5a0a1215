"""The pure core of bsr: registration, accounting, planning, hit bitmaps, chunk keys and the commit rule.

Nothing here performs I/O or imports torch, rich, textual, typer, httpx or yaml; tests/test_layering.py proves it
by importing every module of this package in a fresh interpreter.
"""
