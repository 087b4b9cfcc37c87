"""The language: text -> Spec (read, parse, syntax, resolve) and its diagnostics."""
